"""The launcher's API messages (``/status``, ``/restart``, ``/stop``), what its status
carries (the standby, the restore order, the training's progress, the parked epoch), and the
failure hint a launcher sends to the operator."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gemini.control.strict import Fields, is_int

RESTORE_SOURCES = ("local", "peer", "s3")
LAUNCHER_STATES = ("starting", "held", "running", "parked", "exited", "stopped")
RESTART_RESULTS = ("restarted", "already")
MAX_RESTART_ENV = 64  # names a restart may add to the training process's environment


# -- the launcher ------------------------------------------------------------------------------

@dataclass(frozen=True)
class RestartRequest:
    """POST /restart: run the training again as `epoch`, restoring `version` (a step,
    "latest", or None: a fresh start) from `source`; `env` is merged into its environment
    (e.g. this epoch's MASTER_ADDR/MASTER_PORT). See rule 6 in gemini.control.paths."""

    epoch: int
    version: int | str | None = None
    source: str = "local"
    env: Mapping[str, str] | None = None

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"epoch": self.epoch, "version": self.version,
                               "source": self.source}
        if self.env is not None:
            doc["env"] = dict(self.env)
        return doc

    @classmethod
    def from_json(cls, doc: object) -> RestartRequest:
        f = Fields(doc, "/restart body")
        version = f.raw("version")
        if not (version is None or version == "latest" or (is_int(version) and version >= 0)):
            raise f.fail("version", 'a step number, "latest" or null', version)
        source = f.raw("source")
        source = "local" if source is None else source
        if source not in RESTORE_SOURCES:
            raise f.fail("source", f"one of {', '.join(RESTORE_SOURCES)}", source)
        return cls(f.integer("epoch", 0), version, source, _restart_env(f))


def _restart_env(f: Fields) -> dict[str, str] | None:
    env = f.raw("env")
    if env is None:
        return None
    if not isinstance(env, dict) or len(env) > MAX_RESTART_ENV or not all(
        isinstance(k, str) and k and "=" not in k and "\0" not in k
        and isinstance(v, str) and "\0" not in v for k, v in env.items()
    ):
        raise f.fail("env", f"an object of at most {MAX_RESTART_ENV} names (no '=') to "
                            "string values", env)
    return dict(env)


@dataclass(frozen=True)
class StandbyState:
    """The warm standby interpreter prepared for the next run."""

    pid: int
    ready: bool

    def to_json(self) -> dict[str, Any]:
        return {"pid": self.pid, "ready": self.ready}


@dataclass(frozen=True)
class RestoreOrder:
    """What the current run was told to restore (a version from the environment is text)."""

    version: int | str | None
    source: str

    def to_json(self) -> dict[str, Any]:
        return {"version": self.version, "source": self.source}


@dataclass(frozen=True)
class Progress:
    """The training's last heartbeat: its step, its unix time, and its age in seconds."""

    step: int
    unix: float
    age_s: float

    def to_json(self) -> dict[str, Any]:
        return {"step": self.step, "unix": self.unix, "age_s": self.age_s}


@dataclass(frozen=True)
class FailureHint:
    """POST /v1/hints/failure, to the operator, by a launcher whose training just failed
    (exited or parked), with the job token: "poll my job now". The operator still learns what
    failed from its own poll; the hint only ends the wait for it, so a forged one costs no more
    than a poll of the sender's own job."""

    namespace: str
    job: str
    uid: str
    rank: int
    epoch: int

    def to_json(self) -> dict[str, Any]:
        return {"namespace": self.namespace, "job": self.job, "uid": self.uid,
                "rank": self.rank, "epoch": self.epoch}

    @classmethod
    def from_json(cls, doc: object) -> FailureHint:
        f = Fields(doc, "/v1/hints/failure body")
        return cls(namespace=f.string("namespace"), job=f.string("job"), uid=f.string("uid"),
                   rank=f.integer("rank", 0), epoch=f.integer("epoch", 0))


@dataclass(frozen=True)
class HintAnswer:
    polling: bool  # False: the job was polled moments ago, or is polled already

    def to_json(self) -> dict[str, Any]:
        return {"polling": self.polling}

    @classmethod
    def from_json(cls, doc: object) -> HintAnswer:
        return cls(Fields(doc, "/v1/hints/failure answer").boolean("polling"))


@dataclass(frozen=True)
class LauncherStatus:
    """GET /status (also the answer of POST /stop, and the launcher's status file)."""

    state: str  # one of LAUNCHER_STATES
    pid: int | None
    epoch: int
    restarts: int
    exit_code: int | None
    exited_at: float | None
    started_at: float | None
    warm: bool
    standby: StandbyState | None
    restore: RestoreOrder
    progress: Progress | None
    port: int
    in_process: int = 0  # restarts a parked process took in place (gemini_trainer.inprocess)
    error: str | None = None  # while parked: what failed

    def to_json(self) -> dict[str, Any]:
        return {"state": self.state, "pid": self.pid, "epoch": self.epoch,
                "restarts": self.restarts, "exit_code": self.exit_code,
                "exited_at": self.exited_at, "started_at": self.started_at, "warm": self.warm,
                "standby": None if self.standby is None else self.standby.to_json(),
                "restore": self.restore.to_json(),
                "progress": None if self.progress is None else self.progress.to_json(),
                "port": self.port, "in_process": self.in_process, "error": self.error}

    @classmethod
    def from_json(cls, doc: object, where: str = "/status answer") -> LauncherStatus:
        f = Fields(doc, where)
        state = f.string("state")
        if state not in LAUNCHER_STATES:
            raise f.fail("state", f"one of {', '.join(LAUNCHER_STATES)}", state)
        return cls(state, f.opt_integer("pid"), f.integer("epoch", 0), f.integer("restarts", 0),
                   f.opt_integer("exit_code"), f.opt_number("exited_at"),
                   f.opt_number("started_at"), f.boolean("warm"), _standby(f), _restore(f),
                   progress_in(f), f.integer("port", 0), f.integer("in_process", 0),
                   f.opt_string("error"))


def _standby(f: Fields) -> StandbyState | None:
    s = f.opt_obj("standby")
    return None if s is None else StandbyState(s.integer("pid"), s.boolean("ready"))


def _restore(f: Fields) -> RestoreOrder:
    r = f.obj("restore")
    version = r.raw("version")
    if not (version is None or isinstance(version, str) or is_int(version)):
        raise r.fail("version", "a step number, a string or null", version)
    return RestoreOrder(version, r.string("source"))


@dataclass(frozen=True)
class Parked:
    """An epoch whose training failed while its launcher stays up for the operator's next
    restart: written by the launcher next to the heartbeat, so the sidecar's /inventory
    carries it to the operator (no container restart shows it). ``exit_code`` None: the
    process is alive and waits for an in-process restart; else it exited with that code."""

    epoch: int
    error: str
    unix: float
    exit_code: int | None = None

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"epoch": self.epoch, "error": self.error, "unix": self.unix}
        if self.exit_code is not None:
            doc["exit_code"] = self.exit_code
        return doc

    @classmethod
    def read(cls, f: Fields) -> Parked:
        return cls(f.integer("epoch"), f.string("error")[:PARKED_ERROR_CHARS], f.number("unix"),
                   f.opt_integer("exit_code"))


PARKED_ERROR_CHARS = 2000
# How a launcher's Parked.error begins when the kernel's OOM killer ended the training process
# (gemini_trainer.oom); the operator then reports the rank as OOMKilled.
OUT_OF_MEMORY = "out of memory:"


def parked_in(f: Fields) -> Parked | None:
    """The `parked` field of a status or an inventory (None when missing or null)."""
    p = f.opt_obj("parked")
    return None if p is None else Parked.read(p)


def progress_in(f: Fields) -> Progress | None:
    """The `progress` field of a status or an inventory (None when missing or null)."""
    p = f.opt_obj("progress")
    return None if p is None else Progress(p.integer("step"), p.number("unix"),
                                           p.number("age_s"))


@dataclass(frozen=True)
class RestartAnswer:
    """POST /restart: "restarted", or "already" (that epoch runs), with the status after."""

    result: str  # one of RESTART_RESULTS
    status: LauncherStatus

    def to_json(self) -> dict[str, Any]:
        return {"result": self.result, **self.status.to_json()}

    @classmethod
    def from_json(cls, doc: object) -> RestartAnswer:
        f = Fields(doc, "/restart answer")
        result = f.string("result")
        if result not in RESTART_RESULTS:
            raise f.fail("result", f"one of {', '.join(RESTART_RESULTS)}", result)
        return cls(result, LauncherStatus.from_json(doc, "/restart answer"))
