"""The launcher's state machine: the states of its training process, the transitions between
them, and what a restart asks for (gemini_trainer.launcher; the states are gemini.control's
LAUNCHER_STATES).

    starting -> held                 hold mode: nothing runs until the first restart
    starting | held -> running       the command started
    running -> exited | stopped      the process ended (stopped: the launcher ended it)
    running -> parked                it failed in-process and waits for the next epoch
    parked -> running                a restart handed it the new epoch (in place)
    any -> running                   a restart started a new process
    any -> stopped                   POST /stop
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import StrEnum

from gemini.control import launcher
from gemini_trainer import timeline


class LaunchState(StrEnum):
    STARTING = "starting"
    HELD = "held"
    RUNNING = "running"
    PARKED = "parked"
    EXITED = "exited"
    STOPPED = "stopped"


class LauncherError(Exception):
    """A request the launcher refuses as malformed (the API answers 400 Bad Request)."""


class RestartConflict(LauncherError):
    """A restart the launcher's state refuses: it is stopping, or the epoch is not newer
    (the API answers 409 Conflict)."""


@dataclass(frozen=True)
class RestartRequest:
    epoch: int
    version: int | str | None  # a step, "latest", or None (fresh start)
    source: str = "local"
    extra_env: tuple[tuple[str, str], ...] = ()

    @classmethod
    def parse(cls, body: object) -> RestartRequest:
        """A POST /restart body, checked by the contract (a bad one: LauncherError)."""
        try:
            req = launcher.RestartRequest.from_json(body)
        except ValueError as err:
            raise LauncherError(str(err)) from err
        return cls(req.epoch, req.version, req.source, tuple(sorted((req.env or {}).items())))

    def env(self) -> dict[str, str]:
        version = "none" if self.version is None else str(self.version)
        return {
            **dict(self.extra_env),
            timeline.ENV: f"{time.time():.3f}",  # the trainer's restart timeline counts from it
            "GEMINI_RESTART_EPOCH": str(self.epoch),
            "GEMINI_RESTORE_VERSION": version,
            "GEMINI_RESTORE_SOURCE": self.source,
        }

    def restore(self) -> launcher.RestoreOrder:
        return launcher.RestoreOrder(self.version, self.source)


@dataclass
class LaunchRecord:
    """What GET /status says of the training process; changed only by the transitions below
    (under the launcher's lock)."""

    epoch: int
    restore: launcher.RestoreOrder
    state: LaunchState = LaunchState.STARTING
    restarts: int = 0
    in_process: int = 0  # restarts answered by a parked process (no new process)
    exit_code: int | None = None
    exited_at: float | None = None
    started_at: float | None = None
    warm: bool = False  # the current process(es) started from warm standbys
    error: str = field(default="")  # what a parked process failed with

    def hold(self) -> None:
        self.state = LaunchState.HELD

    def restarted(self, req: RestartRequest) -> None:
        """A restart to ``req``'s epoch was accepted (then ``started`` or ``resumed``)."""
        self.epoch = req.epoch
        self.restarts += 1
        self.restore = req.restore()

    def started(self, warm: bool) -> None:
        self.state, self.warm = LaunchState.RUNNING, warm
        self.exit_code, self.exited_at = None, None
        self.started_at = time.time()

    def resumed(self) -> None:
        """A parked process took the new epoch in place."""
        self.in_process += 1
        self.started(self.warm)
        self.error = ""

    def exited(self, code: int, stopping: bool) -> None:
        self.exit_code, self.exited_at = code, time.time()
        self.state = LaunchState.STOPPED if stopping else LaunchState.EXITED

    def parked(self, error: str) -> None:
        self.state, self.error = LaunchState.PARKED, error
        self.exited_at = time.time()

    def stopped(self) -> None:
        self.state = LaunchState.STOPPED

    def final_code(self, stopping: bool) -> int:
        """The launcher's exit code: 0 once stopped, else the last process's."""
        if stopping:
            return 0
        return self.exit_code if self.exit_code is not None else 0

    def status(self, pid: int | None, standby: launcher.StandbyState | None,
               progress: launcher.Progress | None, port: int) -> launcher.LauncherStatus:
        return launcher.LauncherStatus(
            state=self.state.value, pid=pid, epoch=self.epoch, restarts=self.restarts,
            exit_code=self.exit_code, exited_at=self.exited_at, started_at=self.started_at,
            warm=self.warm, standby=standby, restore=self.restore, progress=progress,
            port=port, in_process=self.in_process, error=self.error or None,
        )
