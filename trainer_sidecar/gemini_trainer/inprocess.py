"""In-process restarts: a training process that survives a failure of the job keeps running.

    from gemini_trainer import run
    if __name__ == "__main__":
        sys.exit(run(main))

``run(main)`` calls ``main()``; when it returns 0/None (or raises SystemExit(0)) training is
done. When it fails (an exception, typically a collective broken by a peer that died, or a
non-zero return) the process does not exit: it closes its Checkpointers, destroys the
torch.distributed process groups (and DeepSpeed's communication state), and parks on its line
to the launcher (gemini_trainer.resume_link). The operator's recovery restarts the job; the
launcher then hands this process the new epoch's environment (rendezvous address, restore
version and source), ``run`` applies it to ``os.environ`` and calls ``main()`` again, which
builds its model and process group anew and restores from memory, with torch, DeepSpeed and
the script's modules already imported. A survivor's restart costs a rendezvous and a restore,
not an interpreter start.

SIGUSR1 asks a running process to park (the launcher sends it when a restart arrives before
the process noticed the failure): the handler says "parking" on the line and raises
``RestartRequested`` in the main thread; in a process whose ``main()`` already failed (on its
way to park) it only says "parking".
A process stuck in a collective that does not return (a peer vanished without closing its
sockets) cannot run the handler; the launcher then ends it after a grace period and starts a
fresh one, as without ``run``.

What ``main`` must allow: being called again in the same process. Build the model, optimizer,
process group and Checkpointer inside it (not at import time), keep no state in globals that
a second call would trip over, and read the rank and rendezvous settings from ``os.environ``
each time. Code that cannot be re-entered keeps the full restart: call ``main()`` directly.
Without a launcher line (no GEMINI_INPROCESS_SOCKET, e.g. a plain torchrun) ``run`` is just
``main()``.
"""

from __future__ import annotations

import gc
import os
import re
import signal
import socket
import stat
import sys
import threading
import time
import traceback
import urllib.parse
from collections.abc import Callable, Mapping
from typing import Any

from gemini_trainer.resume_link import ProcessLink

MainFunction = Callable[[], Any]


class RestartRequested(Exception):
    """Raised in the main thread by SIGUSR1: the launcher wants this process parked."""


_armed = threading.Event()  # SIGUSR1 raises only while main() runs
_failing = threading.Event()  # main() failed and the process has not said "parked" yet


def _on_sigusr1(link: ProcessLink) -> None:
    if _armed.is_set():
        _armed.clear()
        link.parking()  # before the unwind: the launcher then waits past its grace
        raise RestartRequested("the launcher asked for an in-process restart")
    if _failing.is_set():
        link.parking()  # already on its way to park: the launcher waits for it


def run(main: MainFunction) -> int:
    """Run ``main`` until it succeeds, restarting it in this process on each new epoch the
    launcher sends after a failure. Returns the exit code for ``sys.exit``."""
    link = ProcessLink.connect()
    if link is None:
        code = _exit_code(main())
        let_go()
        return code
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGUSR1, lambda _sig, _frame: _on_sigusr1(link))
    try:
        while True:
            failure = _attempt(main)
            if failure is None:
                let_go()
                return 0
            _say(f"training failed in epoch {os.environ.get('GEMINI_RESTART_EPOCH', '0')}; "
                 f"parked for an in-process restart: {failure.splitlines()[-1][:300]}")
            parked = link.park(failure)  # first: the launcher's grace does not cover teardown
            _failing.clear()
            started = time.monotonic()
            teardown()
            _say(f"tore the failed attempt down in {time.monotonic() - started:.2f} s")
            env = link.next_epoch() if parked else None
            if env is None:
                _say("the launcher ended the line; exiting")
                return 1
            apply_env(env)
            epoch = int(env.get("GEMINI_RESTART_EPOCH", "0") or 0)
            _say(f"in-process restart: epoch {epoch} (pid {os.getpid()}), restore "
                 f"{env.get('GEMINI_RESTORE_VERSION', 'none')} from "
                 f"{env.get('GEMINI_RESTORE_SOURCE', 'local')}")
            link.resumed(epoch)
    finally:
        _armed.clear()
        _failing.clear()
        link.close()


def _attempt(main: MainFunction) -> str | None:
    """One call of ``main``: None when training is done, else what failed (text only, so no
    frame keeps the old model alive)."""
    _armed.set()
    try:
        # Disarmed before anything handles main()'s end: a SIGUSR1 that lands while a failure
        # is handled (formatting a deep traceback takes a while on a busy machine) raised out
        # of this function, and the process exited instead of parking. One that lands before
        # the disarm raises inside the outer try and is caught like any failure.
        try:
            code = main()
        finally:
            _armed.clear()
    except SystemExit as stop:
        code = stop.code
    except Exception:  # any failure of the user's code parks the process
        _failing.set()
        return traceback.format_exc()
    if _exit_code(code) == 0:
        return None
    _failing.set()
    return f"main() ended with {code!r}"


def _exit_code(code: Any) -> int:
    if code is None:
        return 0
    if isinstance(code, bool):
        return int(code)
    return code if isinstance(code, int) else 1


def teardown() -> None:
    """What a failed attempt leaves: its Checkpointers (their slots' write locks), the
    process groups of the broken collective, DeepSpeed's communication backend."""
    checkpointer = sys.modules.get("gemini_trainer.checkpointer")
    if checkpointer is not None:
        checkpointer.close_all()
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        _abort_groups(dist)
    _reset_counters()
    let_go()  # the next attempt's engine builds DeepSpeed's backend on the new group
    hang_up_connections(keep_ports=_sidecar_ports())


def let_go() -> None:
    """After main() returned: drop what keeps process groups alive (DeepSpeed's globals,
    reference cycles) while the interpreter is whole. A gloo group that lives into the
    interpreter's finalization is destroyed there, its worker threads can no longer take the
    GIL, and a finished training ends by SIGABRT ("terminate called without an active
    exception", seen once in CI after the last step)."""
    comm: Any = sys.modules.get("deepspeed.comm.comm")
    if comm is not None:
        comm.cdb = None
    for name in _GROUP_CACHES:
        module = sys.modules.get(name)
        if module is not None:
            _forget_groups(module)
    gc.collect()


# Modules that keep process groups in globals (DeepSpeed's world, data- and model-parallel
# groups): the next attempt's engine must build them on the new process group.
_GROUP_CACHES = ("deepspeed.utils.groups", "deepspeed.runtime.sequence_parallel.parallel_state_sp")
_GROUP_GLOBAL = re.compile(r"^_[A-Z_]*GROUP[A-Z_]*$|^_MPU_[A-Z_]+$|^mpu$|^mesh_device$")


# Class-level counters that number what an engine builds: ZeRO-3 names every parameter by a
# process-wide count (ds_id) that all ranks must agree on, so a second model in a process
# that restarted in place must be numbered from 0 like a fresh process's.
_COUNTERS = {
    "deepspeed.runtime.zero.partition_parameters": {
        "Init": ("param_id", "num_persisted_parameters", "num_persisted_elements"),
        "InsertPostInitMethodToModuleSubClasses": ("num_module_parameters",
                                                   "num_module_elements"),
    },
}


# ... and a mutable default argument that numbers ZeRO-3's modules (module.ds_id) the same way.
_DEFAULT_COUNTERS = {
    "deepspeed.runtime.zero.parameter_offload": (
        ("DeepSpeedZeRoOffload", "_register_deepspeed_module"),),
}


def _reset_counters() -> None:
    for module_name, classes in _COUNTERS.items():
        module = sys.modules.get(module_name)
        for class_name, names in classes.items():
            owner = getattr(module, class_name, None)
            for name in names if owner is not None else ():
                setattr(owner, name, 0)
    for module_name, methods in _DEFAULT_COUNTERS.items():
        module = sys.modules.get(module_name)
        for class_name, method in methods:
            function = getattr(getattr(module, class_name, None), method, None)
            for default in getattr(function, "__defaults__", None) or ():
                if isinstance(default, list) and default and isinstance(default[0], int):
                    default[0] = 0


def _forget_groups(module: Any) -> None:
    for name, value in list(vars(module).items()):
        if _GROUP_GLOBAL.match(name):
            setattr(module, name, {} if isinstance(value, dict) else None)


def _abort_groups(dist: Any) -> None:
    """Abort every process group, then forget them. Aborting closes each group's
    connections now: a group merely destroyed lives on while anything (an engine, a
    Checkpointer, a cycle) still references it, and a peer blocked in a collective on it
    would wait for its timeout instead of failing at once and parking too."""
    c10d = sys.modules.get("torch.distributed.distributed_c10d")
    abort = getattr(c10d, "_abort_process_group", None)
    try:
        if abort is not None:
            abort()
            return
    except Exception as err:  # not every backend and version can abort
        _say(f"aborting the old process groups: {err}")
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception as err:  # a broken group may fail to say goodbye
        _say(f"destroying the old process group: {err}")


def hang_up_connections(keep_ports: frozenset[int] = frozenset()) -> int:
    """Shut down this process's connected TCP sockets (but those to `keep_ports`): the
    failed epoch's collectives and rendezvous. gloo closes a group's connections only when
    the last reference to the group goes (neither destroy nor abort does, measured with
    torch 2.13), so without this a peer blocked on a connection to this process would wait
    for its timeout instead of failing at once and parking too. Returns how many."""
    done = 0
    for name in os.listdir("/proc/self/fd") if os.path.isdir("/proc/self/fd") else ():
        try:
            fd = int(name)
            if not stat.S_ISSOCK(os.fstat(fd).st_mode):
                continue
            sock = socket.socket(fileno=os.dup(fd))
        except (OSError, ValueError):
            continue
        with sock:
            try:
                if sock.family not in (socket.AF_INET, socket.AF_INET6) or (
                        sock.type != socket.SOCK_STREAM):
                    continue
                peer = sock.getpeername()  # OSError: not connected (e.g. a listener)
                if peer[1] in keep_ports:
                    continue
                sock.shutdown(socket.SHUT_RDWR)
                done += 1
            except OSError:
                continue
    return done


def _sidecar_ports() -> frozenset[int]:
    url = os.environ.get("GEMINI_SIDECAR_URL", "")
    try:
        port = urllib.parse.urlsplit(url).port if url else None
    except ValueError:
        port = None
    return frozenset({port}) if port else frozenset()


def apply_env(env: Mapping[str, str]) -> None:
    """Make ``os.environ`` the new epoch's environment (added, changed and removed names)."""
    for name in [n for n in os.environ if n not in env]:
        del os.environ[name]
    for name, value in env.items():
        if os.environ.get(name) != value:
            os.environ[name] = value


def _say(message: str) -> None:
    print(f"gemini: {message}", file=sys.stderr, flush=True)
