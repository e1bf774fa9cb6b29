"""The launcher's supervisor: runs the training command, watches it, restarts it on request,
in place when the process parked (see gemini_trainer.launcher for the whole behaviour; its
HTTP API is gemini_trainer.launcher_server's, its states gemini_trainer.launch_state's)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import tempfile
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gemini.control import files, launcher
from gemini_trainer import launcher_metrics, oom, resume_link
from gemini_trainer import standby as warm
from gemini_trainer.launch_config import LauncherConfig
from gemini_trainer.launch_processes import Child, TrainingProcesses
from gemini_trainer.launch_state import (
    LaunchRecord,
    LaunchState,
    RestartConflict,
    RestartRequest,
)
from gemini_trainer.local_group import LocalGroup, local_world_size
from gemini_trainer.resume_link import LinkServer
from gemini_trainer.standby import PythonCommand
from gemini_trainer.standby_pool import StandbyPool

log = logging.getLogger(__name__)

# A Unix socket path holds at most 107 bytes: the in-process link's is <root>/<dir>/<name>.
_SOCKET_SUFFIX = len("/gemini-launch-xxxxxxxx/inprocess.sock")


def socket_tmp_root() -> str:
    """TMPDIR, unless a socket made in it would not fit: then /tmp."""
    root = tempfile.gettempdir()
    return root if len(os.fsencode(root)) + _SOCKET_SUFFIX <= 107 else "/tmp"


class Supervisor:
    """Runs the command, watches it, restarts it on request. ``port``: the API's, for the
    status (set by whoever serves it)."""

    def __init__(self, config: LauncherConfig, env: Mapping[str, str] | None = None) -> None:
        if not config.command:
            raise ValueError("no command to launch: use `gemini launch -- <command> [args]`")
        self.config = config
        self.port = 0
        self._base_env = dict(os.environ if env is None else env)
        self._lock = threading.RLock()
        self._restart_lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._proc: Child | None = None
        self._record = LaunchRecord(
            int(self._base_env.get("GEMINI_RESTART_EPOCH", "0") or 0),
            launcher.RestoreOrder(self._base_env.get("GEMINI_RESTORE_VERSION") or None,
                                  self._base_env.get("GEMINI_RESTORE_SOURCE") or "local"))
        self._parking: int | None = None  # the pid that said it is on its way to park
        # (reset before each SIGUSR1; compared with the asked child's pid)
        self._memory = oom.MemoryCgroup.of_this_process()
        self._stopping = False
        self._done = threading.Event()
        self._tmp = tempfile.TemporaryDirectory(prefix="gemini-launch-", dir=socket_tmp_root())
        self.heartbeat_file = config.heartbeat_file or Path(self._tmp.name) / "heartbeat"
        self.parked_file = files.parked_path(self.heartbeat_file)
        local_world = local_world_size(self._base_env)
        self.processes = TrainingProcesses(config.command, local_world, config.grace_s,
                                           relay=not config.exit_on_failure)
        wanted = config.standby or config.hold_standby
        # next to the heartbeat: on the pod's memory volume, it outlives a container restart
        self.standbys = StandbyPool(PythonCommand.parse(config.command) if wanted else None,
                                    self.processes, config.preimport,
                                    self.heartbeat_file.parent / warm.MODULES_FILE)
        self._link = self._in_process_link(local_world)
        self.metrics = launcher_metrics.make_registry(
            self.status, *launcher_metrics.job_labels(self._base_env))

    def _in_process_link(self, local_world: int) -> LinkServer | None:
        if self.config.in_process and local_world == 1:
            return LinkServer(Path(self._tmp.name) / "inprocess.sock", self._on_parked,
                              self._on_parking)
        if self.config.in_process:
            log.info("no in-process restarts with %d processes per node", local_world)
        return None

    # -- lifecycle ---------------------------------------------------------------------------

    def supervise(self) -> None:
        """Start the command (or hold it) and wait for /stop, a success, or a signal."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            if threading.current_thread() is threading.main_thread():
                signal.signal(
                    sig, lambda *_: threading.Thread(target=self._stop_and_finish).start()
                )
        with self._lock:
            if self.config.hold:
                self._record.hold()
                log.info("holding %s until the first /restart", self.config.command[0])
                self._publish()
                self.standbys.arm(self._child_env({}), busy=False)
            else:
                self._start_child({})
        self._done.wait()

    def close(self) -> int:
        """Let go of the standbys, the link and the temporary files; the launcher's exit code."""
        with self._lock:
            self.standbys.discard()
        if self._link is not None:
            self._link.close()
        self.parked_file.unlink(missing_ok=True)
        self._tmp.cleanup()
        with self._lock:
            return self._record.final_code(self._stopping)

    def _child_env(self, extra_env: Mapping[str, str]) -> dict[str, str]:
        env = {**self._base_env, **extra_env}
        env["GEMINI_RESTART_EPOCH"] = str(self._record.epoch)
        env["GEMINI_HEARTBEAT_FILE"] = str(self.heartbeat_file)
        if self._link is not None:
            env[resume_link.SOCKET_ENV] = str(self._link.path)
        return env

    def _start_child(self, extra_env: Mapping[str, str]) -> None:
        env = self._child_env(extra_env)
        self.heartbeat_file.unlink(missing_ok=True)
        self.parked_file.unlink(missing_ok=True)
        proc, started_warm = self.processes.start(env, *self.standbys.take())
        self._proc = proc
        self._record.started(started_warm)
        log.info("started %s (pid %d, epoch %d, %s)", self.config.command[0], proc.pid,
                 self._record.epoch, "warm standby" if started_warm else "spawned")
        self._publish()
        threading.Thread(target=self._watch, args=(proc,), daemon=True).start()
        if self.config.standby:
            self.standbys.arm(env, busy=True)

    def _watch(self, proc: Child) -> None:
        oom_before = self._memory.oom_kills()
        code = proc.wait()
        words = self.processes.last_words(proc)
        out_of_memory = oom.describe(code, oom_before, self._memory)
        with self._lock:
            if proc is not self._proc:
                return  # an old child replaced by a restart; already accounted for
            self._record.exited(code, self._stopping)
            log.info("training process %d exited with %d (epoch %d)", proc.pid, code,
                     self._record.epoch)
            # The launcher outlives a failed child unless asked to exit with it: then no
            # container restart shows the failure, the marker beside the heartbeat does.
            stays = not self.config.exit_on_failure
            if code != 0 and not self._stopping and stays:
                self._outlive_failure(code, out_of_memory or "", words)
            self._publish()
            self._changed.notify_all()
            if not self._stopping and (code == 0 or not stays):
                self._done.set()

    def _outlive_failure(self, code: int, out_of_memory: str, words: str) -> None:
        """Show a failed child beside the heartbeat, tell the operator, warm the next one."""
        what = out_of_memory or f"the training process exited with code {code}"
        if out_of_memory:
            log.error("%s", out_of_memory)
        epoch = self._record.epoch
        files.write_parked(self.parked_file, launcher.Parked(
            epoch, f"{what}\n{words}", time.time(), code))
        self._hint(epoch)
        if self.config.hold_standby:  # import while the operator detects and plans
            self.standbys.arm(self._child_env({}), busy=False)

    def _hint(self, epoch: int) -> None:
        if self.config.hints is not None:
            self.config.hints.send(epoch)

    def restart(self, req: RestartRequest) -> launcher.RestartAnswer:
        """Run the command again as ``req`` says (RestartConflict: not now, or not newer)."""
        # One restart at a time: a second request waits, then sees the new epoch.
        with self._restart_lock:
            return self._restart(req)

    def _restart(self, req: RestartRequest) -> launcher.RestartAnswer:
        with self._lock:
            self._refuse_if_stopping()
            epoch = self._record.epoch
            if req.epoch == epoch and self._record.restarts > 0:
                return launcher.RestartAnswer("already", self.status_answer())
            if req.epoch <= epoch:
                raise RestartConflict(
                    f"restart epoch {req.epoch} is not newer than the current epoch {epoch}")
            old = self._proc
        if old is not None and self._resume_in_place(old, req):
            return launcher.RestartAnswer("restarted", self.status_answer())
        with self._lock:
            self._proc = None  # the watcher of the old child now ignores its exit
        if old is not None:
            self.processes.terminate(old)
        with self._lock:
            self._refuse_if_stopping()  # /stop arrived while the old process was ending
            self._record.restarted(req)
            self._start_child(req.env())
            return launcher.RestartAnswer("restarted", self.status_answer())

    def _refuse_if_stopping(self) -> None:
        if self._stopping:
            raise RestartConflict("the launcher is stopping")

    # -- in-process restarts (gemini_trainer.inprocess) ------------------------------------

    def _on_parked(self, pid: int, error: str) -> None:
        """A child's training failed and it waits on its line for the next epoch."""
        with self._lock:
            proc = self._proc
            if proc is None or proc.pid != pid or self._record.state != LaunchState.RUNNING:
                return
            self._record.parked(error)
            epoch = self._record.epoch
            log.info("training process %d failed and parked for an in-process restart "
                     "(epoch %d): %s", pid, epoch, error.strip().splitlines()[-1:] or "")
            files.write_parked(self.parked_file, launcher.Parked(epoch, error, time.time()))
            self._publish()
            self._changed.notify_all()
        self._hint(epoch)
        timer = threading.Timer(self.config.park_timeout_s, self._end_parked, (proc, epoch))
        timer.daemon = True
        timer.start()

    def _on_parking(self, pid: int) -> None:
        """A child asked to park (SIGUSR1) runs Python and is unwinding towards its park."""
        with self._lock:
            self._parking = pid
            self._changed.notify_all()

    def _end_parked(self, proc: Child, epoch: int) -> None:
        """No restart reached a parked child in time (no operator, or it gave up on this
        epoch): end it, so the failure shows the usual way (an exit, a container restart)."""
        with self._lock:
            record = self._record
            if proc is not self._proc or record.state != LaunchState.PARKED or (
                    record.epoch != epoch):
                return
        log.warning("no restart reached the parked training process %d in %.0f s; ending it",
                    proc.pid, self.config.park_timeout_s)
        self.processes.terminate(proc)

    def _resume_in_place(self, proc: Child, req: RestartRequest) -> bool:
        """Hand the new epoch to the running child when it can take it (it parks, or parks
        when asked with SIGUSR1 within the grace period); False: start a fresh one."""
        link = self._link
        if link is None or isinstance(proc, LocalGroup) or not link.has(proc.pid):
            return False
        with self._lock:
            if self._record.state == LaunchState.RUNNING:
                self._ask_to_park(proc, link)
            if self._record.state != LaunchState.PARKED or proc is not self._proc or (
                    self._stopping):
                log.info("training process %d did not park; restarting it", proc.pid)
                return False
            previous, self._record.epoch = self._record.epoch, req.epoch
            if not link.order(proc.pid, req.epoch, self._child_env(req.env())):
                self._record.epoch = previous
                return False
            self.heartbeat_file.unlink(missing_ok=True)
            self._record.restarted(req)
            self._record.resumed()
            self.parked_file.unlink(missing_ok=True)
            log.info("restarted training process %d in place (epoch %d)", proc.pid, req.epoch)
            self._publish()
            return True

    def _ask_to_park(self, proc: Child, link: LinkServer) -> None:
        """SIGUSR1, then the grace for the child to park or say it is parking; one that said so
        gets the unwind time (its stack's teardown can take seconds on a busy machine)."""
        self._parking = None
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGUSR1)

        def settled() -> bool:
            return self._record.state != LaunchState.RUNNING or not link.has(proc.pid)

        self._changed.wait_for(lambda: settled() or self._parking == proc.pid,
                               self.config.park_grace_s)
        if settled() or self._parking != proc.pid:
            return
        log.info("training process %d is unwinding towards its park; waiting up to %.0f s",
                 proc.pid, self.config.park_unwind_s)
        self._changed.wait_for(settled, self.config.park_unwind_s)

    def stop(self) -> launcher.LauncherStatus:
        with self._lock:
            self._stopping = True
            proc = self._proc
        if proc is not None:
            self.processes.terminate(proc)
        with self._lock:
            self._record.stopped()
            self.standbys.discard()
            self._publish()
        return self.status_answer()

    def finish(self) -> None:
        """Let ``supervise`` return (after /stop has been answered)."""
        self._done.set()

    def _stop_and_finish(self) -> None:
        self.stop()
        self.finish()

    # -- status ------------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """GET /status as JSON (also the status file and the metrics' source)."""
        return self.status_answer().to_json()

    def status_answer(self) -> launcher.LauncherStatus:
        with self._lock:
            proc = self._proc
            # the last heartbeat the training wrote (None: none yet, or unreadable)
            beat = files.read_heartbeat(self.heartbeat_file)
            return self._record.status(proc.pid if proc is not None else None,
                                       self.standbys.state(), beat, self.port)

    def _publish(self) -> None:
        path = self.config.status_file
        if path is None:
            return
        files.write_atomically(path, json.dumps(self.status(), sort_keys=True) + "\n")
