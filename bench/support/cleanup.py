"""Benchmarks clean up after themselves, also when stopped by SIGTERM or SIGINT (a timeout,
Ctrl-C): whatever they started (local clusters, sidecars, trainers, an S3 server) is stopped.

    from support.cleanup import cleaning_up

    def main() -> None:
        with cleaning_up() as cleanup:
            cleanup.cluster(state_dir)       # `cluster.down` at the end, whatever happens
            cleanup.at_exit(stop_s3, dir)    # any other undo step (run last-in, first-out)
            child = cleanup.spawn([...])     # a child in its own session, stopped at the end
            ...

Inside `cleaning_up()`, the first SIGTERM or SIGINT raises `DemoInterrupted` in the main
thread (the demo's `SignalGuard`), so the bench's own `finally` blocks run; later signals are
remembered only, so a teardown under way is never cut short. At the end (normally, on an
error or a signal) the registered undo steps run with signals deferred, then every child
process still running is stopped (its process group SIGTERMed, SIGKILLed after a grace
period). A bench stopped by a signal prints one line saying so and exits with 128 + the
signal (130 for SIGINT, 143 for SIGTERM).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from gemini_demo.interrupt import DemoInterrupted, SignalGuard


class Cleanup:
    """What a bench started and how to undo it; see the module's docstring. Signals are
    handled by the demo's `SignalGuard` (one mechanism for every tool)."""

    def __init__(self) -> None:
        self.guard = SignalGuard()
        self._undo: list[tuple[str, Callable[[], Any]]] = []
        self._children: list[subprocess.Popen[Any]] = []

    @property
    def received(self) -> int | None:
        """The first signal, if any came."""
        return self.guard.received

    def shielded(self, raise_after: bool = True) -> contextlib.AbstractContextManager[None]:
        """A signal inside the block is raised at its end (e.g. around starting a process
        whose handle must be kept), or only remembered (`raise_after=False`)."""
        return self.guard.shielded(raise_after)

    @property
    def stop_signal(self) -> int:
        """The signal to pass on to children: the one received, else SIGTERM."""
        return self.received if self.received is not None else signal.SIGTERM

    # --- what to undo -------------------------------------------------------------------

    def at_exit(self, fn: Callable[..., Any], *args: Any) -> None:
        """Call fn(*args) at the end, before the children are stopped (last in, first out)."""
        self._undo.append((getattr(fn, "__name__", repr(fn)), lambda: fn(*args)))

    def cluster(self, state_dir: Path) -> Path:
        """Make sure the local cluster of `state_dir` is down at the end (`gemini local
        down`; harmless when it is down already), and no process naming it is left."""
        def down() -> None:
            if state_dir.exists():
                from gemini_local import cluster

                cluster.down(state_dir)
            kill_processes_naming(state_dir)

        self._undo.append((f"cluster.down({state_dir})", down))
        return state_dir

    def spawn(self, argv: Sequence[str], **popen: Any) -> subprocess.Popen[Any]:
        """Popen in a session of its own (a terminal's Ctrl-C reaches only this bench, which
        passes it on with `stop_child`); stopped at the end if still running."""
        with self.shielded():
            proc: subprocess.Popen[Any] = subprocess.Popen(
                list(argv), start_new_session=True, **popen)
            self._children.append(proc)
        return proc

    def stop_child(self, proc: subprocess.Popen[Any], grace: float = 180.0) -> int:
        """Pass the signal this bench got (else SIGTERM) to `proc` and wait up to `grace`
        seconds for it to end (its own teardown), then SIGKILL its process group. Returns
        its exit code. Signals are deferred meanwhile."""
        with self.shielded():
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(self.stop_signal)
                try:
                    proc.wait(timeout=grace)
                except subprocess.TimeoutExpired:
                    print(f"bench: child {proc.pid} did not end within {grace:.0f}s of "
                          f"{signal.Signals(self.stop_signal).name}; killing it",
                          file=sys.stderr, flush=True)
                # what is left of its group (only now: the pid of a child reaped long ago
                # may lead someone else's group by now)
                kill_group(proc.pid, signal.SIGKILL)
            return proc.wait()

    def finish(self) -> None:
        """Undo everything registered, then stop leftover children; a signal meanwhile is
        only remembered (the exit code tells it)."""
        with self.shielded(raise_after=False):
            while self._undo:
                name, undo = self._undo.pop()
                try:
                    undo()
                except Exception as err:  # one failed step must not keep the others
                    print(f"bench: clean-up step {name} failed: {err}", file=sys.stderr,
                          flush=True)
            for proc in self._children:
                if proc.poll() is None:
                    self.stop_child(proc, grace=10.0)
            stop_children(os.getpid(), grace=5.0)


@contextlib.contextmanager
def cleaning_up() -> Iterator[Cleanup]:
    """Run a bench's body with SIGTERM/SIGINT turned into `DemoInterrupted` and cleanup at the
    end; a signal ends the process with 128 + the signal and one line on stderr."""
    cleanup = Cleanup()
    cleanup.guard.install()
    error: BaseException | None = None
    try:
        yield cleanup
    except BaseException as err:  # the bench's own finally blocks ran; the rest below
        error = err
    finally:
        try:
            cleanup.finish()
        finally:
            cleanup.guard.uninstall()
    if cleanup.received is not None:
        if error is not None and not isinstance(error, DemoInterrupted):
            print(f"bench: while stopping: {type(error).__name__}: {error}", file=sys.stderr)
        name = signal.Signals(cleanup.received).name
        print(f"{Path(sys.argv[0]).name}: stopped by {name}; everything it started is "
              "torn down", file=sys.stderr, flush=True)
        raise SystemExit(128 + cleanup.received)
    if error is not None:
        raise error


# --- processes --------------------------------------------------------------------------------


def kill_group(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def _children_of(parent: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[-1].split()
        if int(fields[1]) == parent and fields[0] != "Z":
            found.append(int(entry.name))
    return found


def stop_children(parent: int, grace: float) -> list[int]:
    """SIGTERM every live child of `parent` (the process group too, when the child leads its
    own), SIGKILL after `grace` seconds; return their pids."""
    children = _children_of(parent)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in children:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                if os.getpgid(pid) == pid:
                    os.killpg(pid, sig)
                else:
                    os.kill(pid, sig)
        deadline = time.monotonic() + (grace if sig == signal.SIGTERM else 0)
        while time.monotonic() < deadline and set(children) & set(_children_of(parent)):
            time.sleep(0.05)
    return children


def processes_naming(path: Path) -> list[int]:
    """Pids of the processes whose command line names `path` (or something under it)."""
    own = str(path.resolve()) if path.exists() else str(path)
    needles = {str(path), own}
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            args = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if any(arg == n or arg.endswith("=" + n) or f"{n}/" in arg
               for arg in args for n in needles):
            found.append(int(entry.name))
    return found


def kill_processes_naming(path: Path) -> list[int]:
    """SIGKILL (with their process groups) the processes whose command line names `path`:
    the last resort after `gemini local down`, for a daemon whose pid file was lost."""
    pids = processes_naming(path)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if os.getpgid(pid) == pid:
                os.killpg(pid, signal.SIGKILL)
            else:
                os.kill(pid, signal.SIGKILL)
    return pids
