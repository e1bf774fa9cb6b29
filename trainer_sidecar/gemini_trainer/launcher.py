"""The trainer container's entrypoint: supervise the training process, restart it in place.

``gemini launch -- <command>`` runs the command as a child in its own process group and stays
up when it exits, so a restart costs a process start, not a pod (and the sidecar's memory
survives). The operator drives it over a small HTTP API:

The paths and bodies are gemini.control's (LauncherStatus, RestartRequest, RestartAnswer,
ErrorAnswer), where the ordering rules of restarts are stated too:

    GET  /status    -> {"state": "held"|"running"|"exited"|"stopped", "pid", "epoch", "restarts",
                        "exit_code", "exited_at", "started_at", "restore": {"version",
                        "source"}, "progress": {"step", "unix", "age_s"} | null}
    POST /restart   {"epoch": int, "version": int | "latest" | null, "source": "local"|"peer"|"s3",
                     "env": {"NAME": "value", ...} (optional: merged into the child's environment,
                     e.g. MASTER_ADDR/MASTER_PORT of this epoch's rendezvous)}
                    stops the current process (SIGTERM to its group, SIGKILL after the grace
                    period) and starts the command again with GEMINI_RESTART_EPOCH=epoch,
                    GEMINI_RESTORE_VERSION=version ("none" for null), GEMINI_RESTORE_SOURCE.
                    The epoch must grow: the same epoch again is a no-op (200, "already"), an
                    older one is refused (409), so a retried request cannot restart twice.
    POST /stop      stops the process; the launcher then exits with 0.
    GET  /metrics   Prometheus text (gemini_launcher_*: restarts, epoch, running, last exit
                    code, warm start, start-up seconds, heartbeat step and age); no token.

Every other request needs ``Authorization: Bearer <GEMINI_AUTH_TOKEN>`` (compared in constant
time); others get 401. With GEMINI_CONTROL_TOKEN_SHA256 (the operator renders it) the job
token, which every pod of the job holds, may only read (GET); restart and stop need the
operator's control token, whose SHA-256 that is. The launcher refuses to start without a
token of at least 16 characters, unless GEMINI_LAUNCHER_INSECURE_LOCAL=1 (``--insecure-local``)
asks for an open API on a loopback address, for local runs without an operator. A request must
arrive whole (headers and body) within 10 s, or its connection is closed. It listens on
GEMINI_LAUNCHER_HOST (default 127.0.0.1; the pod IP so the operator can reach it) and
GEMINI_LAUNCHER_PORT (default 7071; 0 picks a free port, written to the status file).

The same status is written atomically to GEMINI_LAUNCHER_STATUS_FILE (if set) on every change.
Progress: the child gets GEMINI_HEARTBEAT_FILE; the trainer library writes "<step> <unix time>"
there after each committed snapshot, and ``progress.age_s`` tells hang detection how long ago
that was. When the child exits 0 the launcher exits 0 (training finished); a failure is
reported and the launcher waits for /restart (or exits with the child's code when
``exit_on_failure`` is set, so the container ends and the node restarts it).

In-process restarts (gemini_trainer.inprocess, gemini_trainer.resume_link; on unless
GEMINI_LAUNCHER_IN_PROCESS=0, one process per node): the child gets GEMINI_INPROCESS_SOCKET, a
Unix socket of the launcher's. A child run through ``gemini_trainer.run`` whose training fails
parks there, alive: ``state`` "parked", ``error`` its traceback's text. The next /restart sends
it the new epoch's environment instead of starting a process (``in_process`` counts these);
a child still running gets SIGUSR1 and GEMINI_LAUNCHER_PARK_GRACE_S (1 s) to park or to say it
is on its way (then GEMINI_LAUNCHER_PARK_UNWIND_S, 8 s, to get there), else it is replaced (a
hung child cannot answer, so a hang still costs only the grace); one parked longer than
GEMINI_LAUNCHER_PARK_TIMEOUT_S (60 s) is ended. Without
``exit_on_failure`` the launcher also outlives a child (or local group) that dies, relaying its
output and keeping the last lines. Either failure is written beside the heartbeat
(``<heartbeat>.parked``: epoch, error or last lines, exit code), where the sidecar's
/inventory reads it for the operator: no container restart (and no kubelet back-off) is needed
to show it. With GEMINI_OPERATOR_HINT_URL (the operator renders it when it serves hints) the
launcher also tells the operator at once (gemini_trainer.failure_hint), which then polls the
job without waiting for its next round.

Hold mode (GEMINI_LAUNCHER_HOLD=1): the command is not started until the first POST /restart,
so the operator can hand every rank the rendezvous address of this epoch (rank 0's pod IP
changes when rank 0 is replaced; there is no cluster DNS to hide that). The child dies with
the launcher (parent-death signal): a killed trainer container leaves no orphaned training.

Several processes per node (GEMINI_NUM_PROC_PER_NODE > 1, as the operator renders
numProcPerNode): the launcher starts that many copies of the command, each with the torchrun
environment of its rank (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, NODE_RANK; MASTER_ADDR
and MASTER_PORT as for one), and supervises them as one (gemini_trainer.local_group): the first
to fail stops the others, a restart restarts all. The command is the training script itself,
not torchrun. A warm standby (below) then means one per local rank.

Warm standby (gemini_trainer.standby; opt-in, GEMINI_LAUNCHER_STANDBY=1): for a ``python ...``
command the launcher keeps one pre-started interpreter per local rank that has imported
torch/DeepSpeed (GEMINI_LAUNCHER_PREIMPORT) and starts the next run in it, skipping the
imports; one extra interpreter per rank in memory. A rank whose standby is not usable is
spawned normally (the others still start warm). ``status.warm`` tells whether the current
process (every one of a local group) started from one, ``status.standby`` ({"pid" of the
first, "ready": all ready} or null) about the next. Without the option a held launcher still
warms the interpreters its first run starts in, and a launcher whose processes died warms
the next ones at once (GEMINI_LAUNCHER_HOLD_STANDBY, default on): the imports of a new or
replacement pod, or of a crashed rank, overlap the operator's detection, planning and
fetching, at no extra memory (no training process runs meanwhile).
"""

from __future__ import annotations

import contextlib
import functools
import io
import ipaddress
import json
import logging
import os
import queue
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from gemini.control import auth, files, messages, paths
from gemini.control import launcher as control_launcher
from gemini_trainer import launcher_metrics, oom, resume_link, timeline
from gemini_trainer import standby as warm
from gemini_trainer.failure_hint import FailureHints
from gemini_trainer.local_group import LocalGroup, local_env, local_world_size, relay_output
from gemini_trainer.resume_link import LinkServer
from gemini_trainer.standby import PythonCommand, Standby

log = logging.getLogger(__name__)

MAX_BODY = 64 * 1024
TAIL_LINES = 20  # of a child's output, for the message of its failure
SOURCES = control_launcher.RESTORE_SOURCES
MAX_ENV = control_launcher.MAX_RESTART_ENV
PR_SET_PDEATHSIG = 1
MIN_TOKEN_LENGTH = 16  # as the sidecar demands of the same per-job token
REQUEST_TIMEOUT_S = 10.0  # a request's headers and body must arrive within this
WRITE_TIMEOUT_S = 10.0  # an answer the client does not read is dropped after this
Child = subprocess.Popen[bytes] | LocalGroup


# A Unix socket path holds at most 107 bytes: the in-process link's is <root>/<dir>/<name>.
_SOCKET_SUFFIX = len("/gemini-launch-xxxxxxxx/inprocess.sock")


def socket_tmp_root() -> str:
    """TMPDIR, unless a socket made in it would not fit: then /tmp."""
    root = tempfile.gettempdir()
    return root if len(os.fsencode(root)) + _SOCKET_SUFFIX <= 107 else "/tmp"


class LauncherConfigError(ValueError):
    """The launcher cannot start as configured; the message says what to set."""


class LauncherError(Exception):
    """A request the launcher refuses; carries the HTTP status to answer with."""

    def __init__(self, message: str, status: HTTPStatus) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class RestartRequest:
    epoch: int
    version: int | str | None  # a step, "latest", or None (fresh start)
    source: str = "local"
    extra_env: tuple[tuple[str, str], ...] = ()

    @classmethod
    def parse(cls, body: object) -> RestartRequest:
        """A POST /restart body, checked by the contract (a bad one: LauncherError 400)."""
        try:
            req = control_launcher.RestartRequest.from_json(body)
        except ValueError as err:
            raise LauncherError(str(err), HTTPStatus.BAD_REQUEST) from err
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


@dataclass(frozen=True)
class LauncherConfig:
    command: tuple[str, ...]
    host: str = "127.0.0.1"
    port: int = 7071
    token: str = field(default="", repr=False)
    # the operator's control token's SHA-256: with it, the job token may only read (/status)
    control_sha256: str = field(default="", repr=False)
    status_file: Path | None = None
    heartbeat_file: Path | None = None  # default: a file in a private temp dir
    grace_s: float = 10.0
    exit_on_failure: bool = False
    hold: bool = False  # wait for the first POST /restart before starting the command
    standby: bool = False  # keep a warm standby interpreter for python commands
    # warm the next process while none runs (held, or after one died): it becomes the
    # training process, so no memory is added
    hold_standby: bool = True
    preimport: tuple[str, ...] = warm.DEFAULT_PREIMPORT  # what the standby imports
    insecure_local: bool = False  # allow no or a short token, on a loopback address only
    in_process: bool = True  # offer in-process restarts (gemini_trainer.run) to the child
    park_grace_s: float = 1.0  # a running child asked to park (SIGUSR1) gets this long
    # one that said it is parking gets this long to get there (within the operator's 15 s
    # deadline for /restart, gemini_operator.calls.sidecars.RESTART_TIMEOUT_SECONDS)
    park_unwind_s: float = 8.0
    park_timeout_s: float = 60.0  # a parked child no restart reached by then is ended
    hints: FailureHints | None = None  # tell the operator of a failure at once

    @classmethod
    def from_env(
        cls, command: Sequence[str], env: Mapping[str, str] | None = None, **overrides: Any
    ) -> LauncherConfig:
        env = os.environ if env is None else env
        status = env.get("GEMINI_LAUNCHER_STATUS_FILE")
        heartbeat = env.get("GEMINI_HEARTBEAT_FILE")
        values: dict[str, Any] = {
            "command": tuple(command),
            "host": env.get("GEMINI_LAUNCHER_HOST") or env.get("GEMINI_POD_IP") or "127.0.0.1",
            "port": int(env.get("GEMINI_LAUNCHER_PORT", "7071")),
            "token": env.get("GEMINI_AUTH_TOKEN", ""),
            "control_sha256": _control_digest(env),
            "status_file": Path(status) if status else None,
            "heartbeat_file": Path(heartbeat) if heartbeat else None,
            "grace_s": float(env.get("GEMINI_LAUNCHER_GRACE_S", "10")),
            "hold": env.get("GEMINI_LAUNCHER_HOLD", "") in ("1", "true", "yes"),
            "standby": warm.enabled(env),
            "hold_standby": warm.hold_enabled(env),
            "preimport": warm.preimport_list(env),
            "insecure_local": env.get("GEMINI_LAUNCHER_INSECURE_LOCAL", "") in (
                "1", "true", "yes"),
            "in_process": resume_link.enabled(env),
            "park_grace_s": float(env.get("GEMINI_LAUNCHER_PARK_GRACE_S", "1")),
            "park_unwind_s": float(env.get("GEMINI_LAUNCHER_PARK_UNWIND_S", "8")),
            "park_timeout_s": float(env.get("GEMINI_LAUNCHER_PARK_TIMEOUT_S", "60")),
            "hints": FailureHints.from_env(env),
        }
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)


class Launcher:
    """Runs the command, watches it, restarts it on request (see the module docstring)."""

    def __init__(self, config: LauncherConfig, env: Mapping[str, str] | None = None) -> None:
        if not config.command:
            raise ValueError("no command to launch: use `gemini launch -- <command> [args]`")
        check_token(config)
        self.config = config
        self._base_env = dict(os.environ if env is None else env)
        self._lock = threading.RLock()
        self._restart_lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._proc: Child | None = None
        self._local_world = local_world_size(self._base_env)
        self._epoch = int(self._base_env.get("GEMINI_RESTART_EPOCH", "0") or 0)
        self._restore = control_launcher.RestoreOrder(
            self._base_env.get("GEMINI_RESTORE_VERSION") or None,
            self._base_env.get("GEMINI_RESTORE_SOURCE") or "local",
        )
        self._restarts = 0
        self._in_process = 0  # restarts answered by a parked process (no new process)
        self._parked_error = ""
        self._parking: int | None = None  # the pid that said it is on its way to park
        # (reset before each SIGUSR1; compared with the asked child's pid)
        self._state = "starting"
        self._exit_code: int | None = None
        self._memory = oom.MemoryCgroup.of_this_process()
        self._exited_at: float | None = None
        self._started_at: float | None = None
        self._stopping = False
        self._done = threading.Event()
        self._tmp = tempfile.TemporaryDirectory(prefix="gemini-launch-", dir=socket_tmp_root())
        self.heartbeat_file = config.heartbeat_file or Path(self._tmp.name) / "heartbeat"
        self._spawner = _Spawner()
        self._output_lock = threading.Lock()
        # pid -> (relay thread, last output lines) of children whose output the launcher relays
        self._relays: dict[int, tuple[list[threading.Thread], deque[bytes]]] = {}
        # the last output lines of the standbys' processes, shared by their local group
        self._standby_tail: deque[bytes] = deque(maxlen=TAIL_LINES)
        wanted = config.standby or config.hold_standby
        self._python = PythonCommand.parse(config.command) if wanted else None
        self._standbys: list[Standby] = []  # one per local rank, or none
        self._warm = False
        # next to the heartbeat: on the pod's memory volume, it outlives a container restart
        self._modules_file = self.heartbeat_file.parent / warm.MODULES_FILE
        self.parked_file = files.parked_path(self.heartbeat_file)
        self._link: LinkServer | None = None
        if config.in_process and self._local_world == 1:
            self._link = LinkServer(Path(self._tmp.name) / "inprocess.sock", self._on_parked,
                                    self._on_parking)
        elif config.in_process:
            log.info("no in-process restarts with %d processes per node", self._local_world)
        self.metrics = launcher_metrics.make_registry(
            self.status, self._base_env.get("GEMINI_JOB", ""),
            self._base_env.get("GEMINI_RANK") or self._base_env.get("RANK", ""))
        self._server = ThreadingHTTPServer((config.host, config.port), _handler_for(self))
        self._server.daemon_threads = True

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    # -- lifecycle ---------------------------------------------------------------------------

    def run(self) -> int:
        """Start the command and serve the API until /stop, a success, or a signal."""
        threading.Thread(
            target=self._server.serve_forever, name="launcher-api", daemon=True
        ).start()
        for sig in (signal.SIGTERM, signal.SIGINT):
            if threading.current_thread() is threading.main_thread():
                signal.signal(
                    sig, lambda *_: threading.Thread(target=self._stop_and_finish).start()
                )
        with self._lock:
            if self.config.hold:
                self._state = "held"
                log.info("holding %s until the first /restart", self.config.command[0])
                self._publish()
                self._arm_standby(self._child_env({}), busy=False)
            else:
                self._start_child({})
        self._done.wait()
        self._server.shutdown()
        self._server.server_close()
        with self._lock:
            self._discard_standby()
        if self._link is not None:
            self._link.close()
        self.parked_file.unlink(missing_ok=True)
        self._tmp.cleanup()
        with self._lock:
            return self._final_code()

    def _final_code(self) -> int:
        if self._stopping:
            return 0
        return self._exit_code if self._exit_code is not None else 0

    def _child_env(self, extra_env: Mapping[str, str]) -> dict[str, str]:
        env = {**self._base_env, **extra_env}
        env["GEMINI_RESTART_EPOCH"] = str(self._epoch)
        env["GEMINI_HEARTBEAT_FILE"] = str(self.heartbeat_file)
        if self._link is not None:
            env[resume_link.SOCKET_ENV] = str(self._link.path)
        return env

    def _start_child(self, extra_env: Mapping[str, str]) -> None:
        env = self._child_env(extra_env)
        self.heartbeat_file.unlink(missing_ok=True)
        self.parked_file.unlink(missing_ok=True)
        proc = self._start_processes(env)
        self._proc = proc
        self._state = "running"
        self._exit_code, self._exited_at = None, None
        self._started_at = time.time()
        log.info("started %s (pid %d, epoch %d, %s)", self.config.command[0], proc.pid,
                 self._epoch, "warm standby" if self._warm else "spawned")
        self._publish()
        threading.Thread(target=self._watch, args=(proc,), daemon=True).start()
        if self.config.standby:
            self._arm_standby(env, busy=True)

    def _start_processes(self, env: Mapping[str, str]) -> Child:
        """The node's training process, or its local group of one process per local rank:
        each from its warm standby where one is usable, else spawned."""
        standbys, self._standbys = self._standbys, []
        tail = self._standby_tail if standbys else deque(maxlen=TAIL_LINES)
        procs: list[subprocess.Popen[bytes]] = []
        warm_ranks = 0
        try:
            for local_rank in range(self._local_world):
                rank_env = self._rank_env(env, local_rank)
                proc = _activate(standbys[local_rank], rank_env) if standbys else None
                warm_ranks += proc is not None
                procs.append(proc or self._spawn_rank(list(self.config.command), rank_env, tail))
        except BaseException:
            LocalGroup(procs, 0.0).signal_groups(signal.SIGKILL)
            for unused in standbys[len(procs):]:  # discarding twice is harmless
                unused.discard()
            raise
        self._warm = warm_ranks == self._local_world
        if self._local_world == 1:
            return procs[0]
        return LocalGroup(procs, self.config.grace_s)

    def _rank_env(self, env: Mapping[str, str], local_rank: int) -> Mapping[str, str]:
        if self._local_world == 1:
            return env
        return local_env(env, local_rank, self._local_world)

    def _spawn_rank(self, command: list[str], env: Mapping[str, str], tail: deque[bytes],
                    **popen: Any) -> subprocess.Popen[bytes]:
        """One process of the node (or its standby): alone as ``_spawn_one``; in a local group
        its output merged, each line prefixed with its rank as torchrun does, the last lines
        in the group's ``tail``."""
        if self._local_world == 1:
            return self._spawn_one(command, env, **popen)
        proc = self._spawner.spawn(command, env, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, **popen)
        relay = relay_output(proc, f"[rank{env['RANK']}]: ".encode(), self._output_lock,
                             tail=tail)
        self._relays[proc.pid] = ([relay], tail)
        return proc

    def _spawn_one(self, command: list[str], env: Mapping[str, str], **popen: Any
                   ) -> subprocess.Popen[bytes]:
        """One training process (or standby). A launcher that outlives a failed child has no
        container exit to show its last words, so it relays the child's output and keeps the
        last lines for the failure's message."""
        if self.config.exit_on_failure:
            return self._spawner.spawn(command, env, **popen)
        proc = self._spawner.spawn(command, env, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, **popen)
        tail: deque[bytes] = deque(maxlen=TAIL_LINES)
        relays = [relay_output(proc, b"", self._output_lock, out, tail, source)
                  for out, source in ((sys.stdout.buffer, proc.stdout),
                                      (sys.stderr.buffer, proc.stderr))]
        self._relays[proc.pid] = (relays, tail)
        return proc

    def _last_words(self, proc: Child) -> str:
        procs = proc.procs if isinstance(proc, LocalGroup) else [proc]
        relays = [r for p in procs if (r := self._relays.pop(p.pid, None)) is not None]
        for threads, _ in relays:
            for thread in threads:
                thread.join(1.0)  # the pipes' last lines may still be on their way
        return b"".join(relays[0][1]).decode(errors="replace") if relays else ""

    # -- warm standby ------------------------------------------------------------------------

    def _arm_standby(self, env: Mapping[str, str], busy: bool) -> None:
        """Pre-start the interpreters for the next run, one per local rank (``busy``: training
        runs alongside, so they import at a low priority)."""
        if self._python is None or self._standbys:
            return
        nice = warm.BUSY_NICE if busy else 0
        # their own tail: what a standby prints while it waits is not the running group's
        self._standby_tail = deque(maxlen=TAIL_LINES)
        spawn = functools.partial(self._spawn_rank, tail=self._standby_tail)
        try:
            for local_rank in range(self._local_world):
                self._standbys.append(Standby(
                    self._python, self._rank_env(env, local_rank), spawn,
                    self.config.preimport, self._modules_file, nice))
        except OSError as err:
            log.warning("no warm standby (%s): restarts spawn fresh processes", err)
            self._discard_standby()

    def _discard_standby(self) -> None:
        standbys, self._standbys = self._standbys, []
        for standby in standbys:
            standby.discard()

    def _watch(self, proc: Child) -> None:
        oom_before = self._memory.oom_kills()
        code = proc.wait()
        words = self._last_words(proc)
        out_of_memory = oom.describe(code, oom_before, self._memory)
        with self._lock:
            if proc is not self._proc:
                return  # an old child replaced by a restart; already accounted for
            self._exit_code, self._exited_at = code, time.time()
            self._state = "stopped" if self._stopping else "exited"
            log.info("training process %d exited with %d (epoch %d)", proc.pid, code, self._epoch)
            # The launcher outlives a failed child unless asked to exit with it: then no
            # container restart shows the failure, the marker beside the heartbeat does.
            stays = not self.config.exit_on_failure
            if code != 0 and not self._stopping and stays:
                what = out_of_memory or f"the training process exited with code {code}"
                if out_of_memory:
                    log.error("%s", out_of_memory)
                files.write_parked(self.parked_file, control_launcher.Parked(
                    self._epoch, f"{what}\n{words}", time.time(), code))
                self._hint(self._epoch)
                if self.config.hold_standby:  # import while the operator detects and plans
                    self._arm_standby(self._child_env({}), busy=False)
            self._publish()
            self._changed.notify_all()
            if not self._stopping and (code == 0 or not stays):
                self._done.set()

    def _hint(self, epoch: int) -> None:
        if self.config.hints is not None:
            self.config.hints.send(epoch)

    def _terminate(self, proc: Child) -> None:
        if proc.poll() is not None:
            return
        _signal_group(proc, signal.SIGTERM)
        # A stopped process (a hang injected with SIGSTOP, a debugger) acts on SIGTERM only
        # once continued; without this it would wait out the whole grace (systemd does same).
        _signal_group(proc, signal.SIGCONT)
        try:
            proc.wait(timeout=self.config.grace_s)
        except subprocess.TimeoutExpired:
            _signal_group(proc, signal.SIGKILL)
            proc.wait()

    def restart(self, req: RestartRequest) -> control_launcher.RestartAnswer:
        # One restart at a time: a second request waits, then sees the new epoch.
        with self._restart_lock:
            return self._restart(req)

    def _restart(self, req: RestartRequest) -> control_launcher.RestartAnswer:
        with self._lock:
            if self._stopping:
                raise LauncherError("the launcher is stopping", HTTPStatus.CONFLICT)
            if req.epoch == self._epoch and self._restarts > 0:
                return control_launcher.RestartAnswer("already", self.status_answer())
            if req.epoch <= self._epoch:
                raise LauncherError(
                    f"restart epoch {req.epoch} is not newer than the current epoch {self._epoch}",
                    HTTPStatus.CONFLICT,
                )
            old = self._proc
        if old is not None and self._resume_in_place(old, req):
            return control_launcher.RestartAnswer("restarted", self.status_answer())
        with self._lock:
            self._proc = None  # the watcher of the old child now ignores its exit
        if old is not None:
            self._terminate(old)
        with self._lock:
            if self._stopping:  # /stop arrived while the old process was ending
                raise LauncherError("the launcher is stopping", HTTPStatus.CONFLICT)
            self._epoch = req.epoch
            self._restarts += 1
            self._restore = control_launcher.RestoreOrder(req.version, req.source)
            self._start_child(req.env())
            return control_launcher.RestartAnswer("restarted", self.status_answer())

    # -- in-process restarts (gemini_trainer.inprocess) ------------------------------------

    def _on_parked(self, pid: int, error: str) -> None:
        """A child's training failed and it waits on its line for the next epoch."""
        with self._lock:
            proc = self._proc
            if proc is None or proc.pid != pid or self._state != "running":
                return
            self._state, self._parked_error = "parked", error
            self._exited_at = time.time()
            epoch = self._epoch
            log.info("training process %d failed and parked for an in-process restart "
                     "(epoch %d): %s", pid, epoch, error.strip().splitlines()[-1:] or "")
            files.write_parked(self.parked_file, control_launcher.Parked(epoch, error, time.time()))
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
            if proc is not self._proc or self._state != "parked" or self._epoch != epoch:
                return
        log.warning("no restart reached the parked training process %d in %.0f s; ending it",
                    proc.pid, self.config.park_timeout_s)
        self._terminate(proc)

    def _resume_in_place(self, proc: Child, req: RestartRequest) -> bool:
        """Hand the new epoch to the running child when it can take it (it parks, or parks
        when asked with SIGUSR1 within the grace period); False: start a fresh one."""
        link = self._link
        if link is None or isinstance(proc, LocalGroup) or not link.has(proc.pid):
            return False
        with self._lock:
            if self._state == "running":
                self._ask_to_park(proc, link)
            if self._state != "parked" or proc is not self._proc or self._stopping:
                log.info("training process %d did not park; restarting it", proc.pid)
                return False
            previous, self._epoch = self._epoch, req.epoch
            env = self._child_env(req.env())
            if not link.order(proc.pid, req.epoch, env):
                self._epoch = previous
                return False
            self.heartbeat_file.unlink(missing_ok=True)
            self._restarts += 1
            self._in_process += 1
            self._restore = control_launcher.RestoreOrder(req.version, req.source)
            self._state, self._parked_error = "running", ""
            self._exit_code, self._exited_at = None, None
            self._started_at = time.time()
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
            return self._state != "running" or not link.has(proc.pid)

        self._changed.wait_for(lambda: settled() or self._parking == proc.pid,
                               self.config.park_grace_s)
        if settled() or self._parking != proc.pid:
            return
        log.info("training process %d is unwinding towards its park; waiting up to %.0f s",
                 proc.pid, self.config.park_unwind_s)
        self._changed.wait_for(settled, self.config.park_unwind_s)

    def stop(self) -> control_launcher.LauncherStatus:
        with self._lock:
            self._stopping = True
            proc = self._proc
        if proc is not None:
            self._terminate(proc)
        with self._lock:
            self._state = "stopped"
            self._discard_standby()
            self._publish()
        return self.status_answer()

    def finish(self) -> None:
        """Let ``run`` return (after /stop has been answered)."""
        self._done.set()

    def _stop_and_finish(self) -> None:
        self.stop()
        self.finish()

    def wait_for_exit(self, timeout: float) -> bool:
        """Wait until the current training process has exited (True) or the timeout passed."""
        with self._lock:
            return self._changed.wait_for(lambda: self._state != "running", timeout)

    # -- status ------------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """GET /status as JSON (also the status file and the metrics' source)."""
        return self.status_answer().to_json()

    def status_answer(self) -> control_launcher.LauncherStatus:
        with self._lock:
            proc, standbys = self._proc, self._standbys
            return control_launcher.LauncherStatus(
                state=self._state, pid=proc.pid if proc is not None else None,
                epoch=self._epoch, restarts=self._restarts, exit_code=self._exit_code,
                exited_at=self._exited_at, started_at=self._started_at, warm=self._warm,
                standby=None if not standbys else control_launcher.StandbyState(
                    standbys[0].proc.pid, all(standby.ready() for standby in standbys)),
                restore=self._restore, progress=self.heartbeat(), port=self.port,
                in_process=self._in_process, error=self._parked_error or None,
            )

    def progress(self) -> dict[str, float | int] | None:
        """The last heartbeat: step, its unix time, and its age in seconds."""
        beat = self.heartbeat()
        return None if beat is None else beat.to_json()

    def heartbeat(self) -> control_launcher.Progress | None:
        """The last heartbeat the training wrote (None: none yet, or unreadable)."""
        return files.read_heartbeat(self.heartbeat_file)

    def _publish(self) -> None:
        path = self.config.status_file
        if path is None:
            return
        files.write_atomically(path, json.dumps(self.status(), sort_keys=True) + "\n")

    def authorized(self, header: str | None, method: str = "GET") -> bool:
        """The job token may read (GET); restarts and stops need the operator's control
        token once the pod has its digest (gemini.control.auth.may_call)."""
        if not self.config.token:  # only with insecure_local on loopback (check_token)
            return True
        given = (header or "").encode("utf-8", "surrogateescape")
        return auth.may_call(given, self.config.token.encode(), self.config.control_sha256,
                                job_token_allowed=method == "GET")


def _control_digest(env: Mapping[str, str]) -> str:
    try:
        return auth.control_digest_setting(env)
    except ValueError as err:
        raise LauncherConfigError(str(err)) from err


def check_token(config: LauncherConfig) -> None:
    """Refuse an API anyone could drive: no token, or one short enough to guess, unless the
    local opt-in is set and the API listens on loopback only."""
    if len(config.token) >= MIN_TOKEN_LENGTH:
        return
    problem = ("GEMINI_AUTH_TOKEN is not set" if not config.token else
               f"GEMINI_AUTH_TOKEN is too short ({len(config.token)} of at least "
               f"{MIN_TOKEN_LENGTH} characters)")
    if not config.insecure_local:
        raise LauncherConfigError(
            f"{problem}: the launcher API (restart, stop) would be open to whoever reaches it; set "
            f"a per-job secret of at least {MIN_TOKEN_LENGTH} characters (the operator does), "
            "or for a local run GEMINI_LAUNCHER_INSECURE_LOCAL=1 (--insecure-local)")
    if not _loopback(config.host):
        raise LauncherConfigError(
            f"{problem}, and GEMINI_LAUNCHER_INSECURE_LOCAL allows that only on a loopback "
            f"address, not {config.host}; set a token of at least {MIN_TOKEN_LENGTH} characters")
    log.warning("%s: the launcher API on %s is open to local processes "
                "(GEMINI_LAUNCHER_INSECURE_LOCAL)", problem, config.host)


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class _DeadlineReader(io.RawIOBase):
    """A request's socket, read with what is left of its deadline as the timeout: a client
    that sends headers or body a byte at a time cannot hold a server thread past it."""

    def __init__(self, sock: socket.socket, seconds: float) -> None:
        self._sock = sock
        self._deadline = time.monotonic() + seconds

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the request did not arrive in time")
        self._sock.settimeout(left)
        return self._sock.recv_into(buffer)


class _Spawner:
    """Starts children from one long-lived thread: the parent-death signal fires when the
    *thread* that forked the child ends, and request threads end right after answering."""

    def __init__(self) -> None:
        self._requests: queue.Queue[tuple[list[str], dict[str, Any], queue.Queue[Any]]] = (
            queue.Queue()
        )
        threading.Thread(target=self._serve, name="launcher-spawner", daemon=True).start()

    def spawn(self, command: list[str], env: Mapping[str, str], **popen: Any
              ) -> subprocess.Popen[bytes]:
        """A child in a session of its own, or as ``popen`` overrides say."""
        answer: queue.Queue[Any] = queue.Queue(maxsize=1)
        self._requests.put((command, {"env": dict(env), "start_new_session": True, **popen},
                            answer))
        result = answer.get()
        if isinstance(result, BaseException):
            raise result
        return result  # type: ignore[no-any-return]

    def _serve(self) -> None:
        while True:
            command, popen, answer = self._requests.get()
            try:
                answer.put(subprocess.Popen(command, preexec_fn=_die_with_parent, **popen))
            except BaseException as err:  # handed to the caller, who raises it
                answer.put(err)


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the launcher dies (Linux; elsewhere a no-op)."""
    with contextlib.suppress(OSError, AttributeError):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _activate(standby: Standby, env: Mapping[str, str]) -> subprocess.Popen[bytes] | None:
    """The standby's process running this run, or None (then discarded). Even one still
    importing is a head start: taking over sets its session's autogroup back to nice 0, so
    the rest runs at full priority (without autogroup, only the module in progress finishes
    at the importing thread's nice +10)."""
    if standby.proc.poll() is None:
        proc = standby.activate(env, os.getcwd())
        if proc is not None:
            return proc
        log.info("a warm standby was not usable (%s); spawning",
                 ", ".join(warm.startup_changes(standby.env, env)) or "it ended")
    standby.discard()
    return None


def _signal_group(proc: Child, sig: signal.Signals) -> None:
    if isinstance(proc, LocalGroup):
        proc.signal_groups(sig)
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)


def _handler_for(launcher: Launcher) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        server_version = "gemini-launcher"

        def setup(self) -> None:
            # One request per connection (HTTP/1.0): its deadline covers the request line,
            # the headers and the body; BaseHTTPRequestHandler closes it on TimeoutError.
            super().setup()
            self.rfile.close()
            self.rfile = io.BufferedReader(_DeadlineReader(self.connection, REQUEST_TIMEOUT_S))

        def _send(self, status: HTTPStatus, content_type: str, data: bytes) -> None:
            self.connection.settimeout(WRITE_TIMEOUT_S)  # not what was left of the read's
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:
            log.debug("%s " + format, self.address_string(), *args)

        def _reply(self, status: HTTPStatus, body: Mapping[str, Any]) -> None:
            self._send(status, "application/json", json.dumps(body).encode())

        def _refuse(self, status: HTTPStatus, message: str) -> None:
            self._reply(status, messages.ErrorAnswer(message).to_json())

        def _guard(self) -> bool:
            if launcher.authorized(self.headers.get("Authorization"), self.command):
                return True
            log.warning("refused an unauthenticated %s %s", self.command, self.path)
            self._refuse(HTTPStatus.UNAUTHORIZED, "missing or wrong bearer token")
            return False

        def do_GET(self) -> None:
            if self.path == paths.METRICS_PATH:  # open, like the sidecar's: no token
                data = launcher_metrics.render(launcher.metrics)
                self._send(HTTPStatus.OK, "text/plain; version=0.0.4", data)
                return
            if not self._guard():
                return
            if self.path == paths.STATUS_PATH:
                self._reply(HTTPStatus.OK, launcher.status_answer().to_json())
            else:
                self._refuse(HTTPStatus.NOT_FOUND, f"no such endpoint {self.path}")

        def do_POST(self) -> None:
            if not self._guard():
                return
            try:
                body = self._body()
                if self.path == paths.RESTART_PATH:
                    answer = launcher.restart(RestartRequest.parse(body))
                    self._reply(HTTPStatus.OK, answer.to_json())
                elif self.path == paths.STOP_PATH:
                    self._reply(HTTPStatus.OK, launcher.stop().to_json())
                    launcher.finish()
                else:
                    self._refuse(HTTPStatus.NOT_FOUND, f"no such endpoint {self.path}")
            except LauncherError as err:
                self._refuse(err.status, str(err))

        def _body(self) -> object:
            length = int(self.headers.get("Content-Length") or 0)
            if length > MAX_BODY:
                raise LauncherError("request body too large", HTTPStatus.REQUEST_ENTITY_TOO_LARGE)
            raw = self.rfile.read(length) if length else b"{}"
            try:
                body = json.loads(raw or b"{}")
            except json.JSONDecodeError as err:
                raise LauncherError(f"body is not JSON: {err}", HTTPStatus.BAD_REQUEST) from err
            if not isinstance(body, dict):
                raise LauncherError("body must be a JSON object", HTTPStatus.BAD_REQUEST)
            return body

    return Handler
