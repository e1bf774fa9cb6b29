"""Warm standby: a pre-started interpreter that becomes the next training process.

A restarted trainer spends most of its start-up importing torch and DeepSpeed (seconds of CPU
per rank, and every rank restarts at once). The launcher therefore keeps one interpreter per
rank that has already imported them and sits blocked on a pipe. On restart it receives the
new epoch's argv, environment and working directory, applies them, becomes a process group
leader of its own (as a spawned child would be) and runs the script with ``runpy``: the same
``__main__``, ``sys.argv``, ``sys.path[0]``, exit codes, stdout/stderr and signals as a fresh
``python script.py`` (or ``-m module``, ``-c code``), minus the imports.

What it imports: ``GEMINI_LAUNCHER_PREIMPORT`` (comma-separated module names; ``module:attr``
also reads a lazy attribute, ``module:attr()`` calls it), default ``DEFAULT_PREIMPORT`` (torch
and DeepSpeed; missing ones are skipped), plus every module the previous
training process had loaded once it committed its first snapshot (recorded next to the
heartbeat file, so the list survives a container restart). Once that record exists, default
entries from packages the previous run never imported are dropped (no DeepSpeed for FSDP).
Modules of the script's own directory are never preimported: they may read the epoch's
environment at import time.

Cost: one extra interpreter per rank (torch + DeepSpeed: 0.5-0.7 GB of RSS). While training
runs, the standby imports at a low priority so it takes only idle CPU: its session's autogroup
at nice +10 (the scheduler weighs sessions, not processes, when autogroup is on; set back to 0,
which needs no privilege, when it takes over) and the importing thread at nice +10 (cgroups
without autogroup; Linux nice values are per thread, so the main thread, which runs the
script, keeps its priority). Opt-in for the launcher (``GEMINI_LAUNCHER_STANDBY=1``); the
operator asks for it unless a GeminiJob says ``failurePolicy.warmStandby: false``.
The launcher falls back to a normal spawn when the command is not ``python ...``, the standby
died, or the new environment changes a start-up setting (PATH, PYTHON*, OMP_*, LD_*, ...).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ENABLE_ENV = "GEMINI_LAUNCHER_STANDBY"
HOLD_ENV = "GEMINI_LAUNCHER_HOLD_STANDBY"
PREIMPORT_ENV = "GEMINI_LAUNCHER_PREIMPORT"
# torch._dynamo: every torch optimizer imports it on construction (seconds). DeepSpeed's comm
# start-up probes every op (compiler subprocesses) and JIT-loads its shared-memory op (a ninja
# check under a file lock every rank waits on, a rebuild of minutes when the check fails);
# both results are cached in the process. deepspeed.initialize's optimizer check imports the
# Muon optimizer, whose module-level torch.compile imports Inductor: 2 s of a 3.5 s first
# build with 4 ranks on 2 cores, against 1.2 s once preimported (measured, DeepSpeed 0.19).
DEFAULT_PREIMPORT = ("torch", "torch._dynamo", "deepspeed", "deepspeed.ops:__compatible_ops__",
                     "deepspeed.comm.torch:build_shm_op()", "deepspeed.runtime.engine",
                     "deepspeed.runtime.zero.stage3",
                     "deepspeed.runtime.zero.muon.muon_optimizer")
MODULES_FILE = "standby-modules.json"
STANDBY_NAME = "gemini-standby"  # the process name (comm) of a standby until it takes a run
BUSY_NICE = 10  # while a training process runs on the same CPUs
READY, STARTED = b"r", b"s"
# Read while the interpreter or the preimported modules start: a change needs a fresh process.
STARTUP_PREFIXES = ("PYTHON", "LD_", "OMP_", "MKL_", "KMP_", "DS_", "TORCH", "CUDA", "MALLOC",
                    "GEMINI_LAUNCHER_")
STARTUP_NAMES = frozenset({"PATH", "HOME", "TMPDIR"})
_PYTHON = re.compile(r"python(\d+(\.\d+)?)?$")
_FLAGS = frozenset({"-u", "-B", "-O", "-OO", "-s", "-E", "-q", "-b", "-bb"})
_FLAGS_WITH_VALUE = frozenset({"-X", "-W"})
_BOOT = "from gemini_trainer.standby import serve; serve()"
_LEARN_POLL_S = 0.5
_TERM_CHECK_S = 0.2  # how often an idle standby looks at its SIGTERM flag
_LEARN_LIMIT_S = 600.0


def enabled(env: Mapping[str, str]) -> bool:
    """Opt-in for a bare launcher (GEMINI_LAUNCHER_STANDBY=1; the operator sets it unless the
    job's failurePolicy.warmStandby is false): on a box that runs many pods (the local cluster,
    tests) an interpreter per rank holding torch adds up to gigabytes."""
    return env.get(ENABLE_ENV, "0").strip().lower() in ("1", "true", "yes", "on")


def hold_enabled(env: Mapping[str, str]) -> bool:
    """On unless GEMINI_LAUNCHER_HOLD_STANDBY says 0/false/no/off: a held launcher (a new or
    replacement pod waiting for its first /restart) warms the interpreter that will run the
    training, so the imports overlap the operator's planning and fetching; it costs no more
    memory than the training process it becomes."""
    return env.get(HOLD_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


@dataclass(frozen=True)
class PythonCommand:
    """``python [flags] script|-m module|-c code [args]``: what a standby can run."""

    interpreter: str
    flags: tuple[str, ...]
    kind: str  # "script" | "module" | "code"
    target: str
    args: tuple[str, ...]

    @classmethod
    def parse(cls, command: Sequence[str]) -> PythonCommand | None:
        """None for anything else (another program, stdin, unknown interpreter flags)."""
        if not command or not _PYTHON.match(os.path.basename(command[0])):
            return None
        flags: list[str] = []
        i = 1
        while i < len(command):
            token = command[i]
            if token in _FLAGS:
                flags.append(token)
            elif token in _FLAGS_WITH_VALUE and i + 1 < len(command):
                flags += [token, command[i + 1]]
                i += 1
            elif token in ("-m", "-c") and i + 1 < len(command):
                kind = "module" if token == "-m" else "code"
                return cls(command[0], tuple(flags), kind, command[i + 1],
                           tuple(command[i + 2:]))
            elif token.startswith("-"):
                return None  # stdin ("-"), -i, -I, -S, ...: leave it to a real spawn
            else:
                return cls(command[0], tuple(flags), "script", token, tuple(command[i + 1:]))
            i += 1
        return None

    def boot_command(self, preimport: Sequence[str], modules_file: Path | None,
                     nice: int, fds: tuple[int, int]) -> list[str]:
        return [self.interpreter, *self.flags, "-c", _BOOT, str(fds[0]), str(fds[1]), str(nice),
                str(modules_file or ""), ",".join(preimport)]


def preimport_list(env: Mapping[str, str]) -> tuple[str, ...]:
    raw = env.get(PREIMPORT_ENV)
    if raw is None:
        return DEFAULT_PREIMPORT
    return tuple(name.strip() for name in raw.split(",") if name.strip())


def startup_changes(before: Mapping[str, str], after: Mapping[str, str]) -> list[str]:
    """Names whose change the standby cannot apply after start-up."""
    changed = {k for k in before.keys() | after.keys() if before.get(k) != after.get(k)}
    return sorted(k for k in changed if k in STARTUP_NAMES or k.startswith(STARTUP_PREFIXES))


Spawn = Callable[..., "subprocess.Popen[bytes]"]


class Standby:
    """The launcher's handle on one standby interpreter."""

    def __init__(self, command: PythonCommand, env: Mapping[str, str], spawn: Spawn,
                 preimport: Sequence[str], modules_file: Path | None, nice: int) -> None:
        self.command, self.env, self.nice = command, dict(env), nice
        control_r, self._control_w = os.pipe()
        self._status_r, status_w = os.pipe()
        try:  # in a session (and process group) of its own, as a spawned child
            self.proc = spawn(command.boot_command(preimport, modules_file, nice,
                                                   (control_r, status_w)),
                              self.env, pass_fds=(control_r, status_w))
        except BaseException:
            for fd in (control_r, status_w, self._control_w, self._status_r):
                os.close(fd)
            raise
        os.close(control_r)
        os.close(status_w)
        self._seen = b""

    def ready(self) -> bool:
        """True once the preimports are done (False while importing or when it died)."""
        self._read(0)
        return READY in self._seen and self.proc.poll() is None

    def _read(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            left = max(0.0, deadline - time.monotonic())
            if not select.select([self._status_r], [], [], left)[0]:
                return
            chunk = os.read(self._status_r, 64)
            if not chunk:
                return
            self._seen += chunk
            if STARTED in self._seen or timeout == 0:
                return

    def activate(self, env: Mapping[str, str], cwd: str, timeout: float = 10.0
                 ) -> subprocess.Popen[bytes] | None:
        """Hand over the run; the process once it has taken it, else None."""
        if self.proc.poll() is not None or startup_changes(self.env, env):
            return None
        order = {"kind": self.command.kind, "target": self.command.target,
                 "args": list(self.command.args), "env": dict(env), "cwd": cwd}
        try:
            os.write(self._control_w, json.dumps(order).encode() + b"\n")
        except OSError:
            return None
        finally:
            os.close(self._control_w)
            self._control_w = -1
        self._read(timeout)  # its main thread only reads the pipe and answers
        if STARTED not in self._seen:
            # it has the order and may still run it: it must not run beside a fresh spawn
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            return None
        os.close(self._status_r)
        self._status_r = -1
        return self.proc

    def discard(self) -> None:
        """Let an unused standby go: it exits once its current import ends. Not a kill: one
        killed while DeepSpeed's JIT holds its build lock would leave the lock to every later
        process on the machine."""
        for fd in (self._control_w, self._status_r):
            if fd >= 0:
                os.close(fd)
        self._control_w = self._status_r = -1
        threading.Thread(target=self.proc.wait, name="standby-reaper", daemon=True).start()


# -- the standby interpreter's side ------------------------------------------------------------


def serve() -> None:
    """Entry point in the standby interpreter (argv from ``boot_command``); never returns
    normally until the training script ran: its exit is this process's exit."""
    control_fd, status_fd, nice = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    modules_file = Path(sys.argv[4]) if sys.argv[4] else None
    names = [n for n in sys.argv[5].split(",") if n]
    if nice:
        _autogroup_nice(nice)
    _set_name(STANDBY_NAME)  # ps, top and fault tools tell a waiting standby from training
    stop = _Stop()
    worker = threading.Thread(target=_warm, args=(names, modules_file, nice, status_fd, stop),
                              name="standby-preimport", daemon=True)
    # SIGTERM (also when the launcher dies) ends it after the current import, not within it:
    # DeepSpeed's JIT build holds a file lock that a killed builder never releases. The handler
    # only raises a flag: the launcher's death brings EOF and SIGTERM together, and a handler
    # that took a lock the interrupted main thread held (Event.set, Thread.join) hung forever.
    signal.signal(signal.SIGTERM, lambda *_: stop.terminate())
    _parent_death_signal(signal.SIGTERM)
    worker.start()
    line = _read_line(control_fd, stop)
    stop.set()
    if not line:
        worker.join()  # an import under DeepSpeed's JIT lock must not be cut short
        os._exit(0)  # the launcher went away, discarded us, or asked us to end
    order = json.loads(line)
    if nice:
        _autogroup_nice(0)
    # from here on a training process like a spawned one: default SIGTERM, killed with the
    # launcher (only the preimport thread's current module may still finish first)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _parent_death_signal(signal.SIGKILL)
    _set_name(os.path.basename(sys.executable))  # what a spawned interpreter is called
    if stop.terminated:  # the SIGTERM came with the order: it was meant for the run
        worker.join()
        os._exit(0)
    os.write(status_fd, STARTED)  # at once: the launcher answers /restart on it
    os.close(status_fd)
    os.close(control_fd)
    worker.join()  # the module being imported completes: the script would wait for it anyway
    _run(order, modules_file)


class _Stop(threading.Event):
    """The preimport's stop flag, plus a SIGTERM flag the signal handler sets without a lock."""

    terminated = False

    def terminate(self) -> None:
        self.terminated = True  # a plain attribute: safe in a handler that interrupts anything

    def is_set(self) -> bool:
        return self.terminated or super().is_set()


def _parent_death_signal(sig: int) -> None:
    with contextlib.suppress(OSError, AttributeError):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, sig)  # PR_SET_PDEATHSIG (Linux)


def _set_name(name: str) -> None:
    """The process's name (/proc/<pid>/comm, 15 bytes) on Linux; nothing elsewhere."""
    with contextlib.suppress(OSError, AttributeError):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(15, name.encode()[:15] + b"\0", 0, 0, 0)


def _autogroup_nice(nice: int) -> None:
    with contextlib.suppress(OSError):  # no autogroup (disabled, or not Linux): nothing to do
        Path("/proc/self/autogroup").write_text(f"{nice}\n")


def _read_line(fd: int, stop: _Stop) -> bytes:
    """The launcher's order; empty at EOF or once SIGTERM came (checked between waits: a
    read interrupted by the handler is retried, PEP 475)."""
    data = b""
    while not data.endswith(b"\n"):
        if stop.terminated:
            return b""
        if not select.select([fd], [], [], _TERM_CHECK_S)[0]:
            continue
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            return b""
        data += chunk
    return data


def _warm(names: list[str], modules_file: Path | None, nice: int, status_fd: int,
          stop: _Stop) -> None:
    if nice:
        with contextlib.suppress(OSError):
            os.nice(nice)  # this thread only (Linux): the main thread keeps its priority
    for name in drop_unused_defaults(names, _learned(modules_file)):
        if stop.is_set():
            return
        _preimport(name)
    with contextlib.suppress(OSError):
        os.write(status_fd, READY)
    seen_mtime = 0.0
    while modules_file is not None and not stop.is_set():
        mtime = _mtime(modules_file)
        if mtime != seen_mtime:
            seen_mtime = mtime
            for name in _learned(modules_file) or ():
                if stop.is_set():
                    return
                if name not in sys.modules:
                    _preimport(name)
        stop.wait(1.0)  # the current run writes its list once it committed a snapshot


def drop_unused_defaults(names: Sequence[str], learned: Sequence[str] | None) -> list[str]:
    """The preimport list once a previous run's modules are known: an entry of the default
    list whose top-level package that run never imported is dropped (an FSDP script needs no
    DeepSpeed, whose Muon import alone costs seconds of CPU); entries a user listed stay."""
    if not learned:
        return list(names)
    packages = {_package(name) for name in learned}
    return [spec for spec in names if spec not in DEFAULT_PREIMPORT or _package(spec) in packages]


def _package(spec: str) -> str:
    """The top-level package of a module name or preimport entry (``deepspeed.comm:f()``)."""
    return spec.partition(":")[0].partition(".")[0]


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def _learned(modules_file: Path | None) -> list[str] | None:
    """The modules a previous run had imported (None: no run recorded them yet)."""
    if modules_file is None:
        return None
    try:
        names = json.loads(modules_file.read_text())
    except (OSError, ValueError):
        return None
    return [n for n in names if isinstance(n, str)] if isinstance(names, list) else None


def _preimport(spec: str) -> None:
    """Import one module (``module:attr`` also reads the attribute, ``module:attr()`` calls
    it); failures are the script's to meet, not the standby's."""
    name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(name)
        if attr.endswith("()"):
            getattr(module, attr[:-2])()
        elif attr:
            getattr(module, attr)
    except BaseException:  # SystemExit/KeyboardInterrupt raised by a module too
        return


def _run(order: Mapping[str, Any], modules_file: Path | None) -> None:
    os.chdir(order["cwd"])
    os.environ.clear()
    os.environ.update(order["env"])
    kind, target, args = order["kind"], order["target"], list(order["args"])
    if kind == "script":
        sys.argv = [target, *args]
        script_dir = os.path.dirname(os.path.abspath(target))
        sys.path[0] = script_dir
    else:
        sys.argv = ["-m" if kind == "module" else "-c", *args]
        script_dir = os.getcwd()
        sys.path[0] = script_dir if kind == "module" else ""
    if modules_file is not None:
        threading.Thread(target=_learn, args=(modules_file, script_dir), daemon=True,
                         name="standby-learn").start()
    import runpy

    if kind == "script":
        runpy.run_path(target, run_name="__main__")
    elif kind == "module":
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        main = sys.modules["__main__"]
        main.__dict__.pop("serve", None)  # what the boot line left behind
        exec(compile(target, "<string>", "exec"), main.__dict__)


def _learn(modules_file: Path, script_dir: str) -> None:
    """Once the trainer committed its first snapshot (start-up over, its lazy imports done),
    record what it had imported for the next standby."""
    heartbeat = os.environ.get("GEMINI_HEARTBEAT_FILE")
    if not heartbeat:
        return  # no way to tell when start-up is over
    deadline = time.monotonic() + _LEARN_LIMIT_S
    while not os.path.exists(heartbeat):
        if time.monotonic() > deadline:
            return
        time.sleep(_LEARN_POLL_S)
    names = [name for name, module in list(sys.modules.items())
             if _learnable(name, getattr(module, "__file__", None), script_dir)]
    tmp = modules_file.with_name(modules_file.name + f".{os.getpid()}.tmp")
    with contextlib.suppress(OSError):
        tmp.write_text(json.dumps(names))
        os.replace(tmp, modules_file)


def _learnable(name: str, file: object, script_dir: str) -> bool:
    if name in ("__main__", "__mp_main__") or not isinstance(file, str):
        return False
    return not os.path.abspath(file).startswith(script_dir + os.sep)
