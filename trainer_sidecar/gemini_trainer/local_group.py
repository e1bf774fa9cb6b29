"""The training processes of one node, started and supervised as one (what torchrun does).

With numProcPerNode P > 1 the launcher starts P copies of the command, each with the torchrun
environment of its global rank (``local_env``). ``LocalGroup`` stands for them where the
launcher handles one process: the first one to fail stops the others (they would hang in a
broken collective) and its code is the group's; the group succeeds when all exit 0. A restart
restarts all of them in place. Their output reaches the launcher's, each line prefixed with the
process's rank (``[rank5]: ``), as torchrun prefixes it, so one container log stays readable.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Mapping
from typing import IO

_POLL_S = 0.05


def local_world_size(env: Mapping[str, str]) -> int:
    """Training processes per node (GEMINI_NUM_PROC_PER_NODE, as the operator renders it)."""
    raw = env.get("GEMINI_NUM_PROC_PER_NODE", "1") or "1"
    size = int(raw)
    if size < 1:
        raise ValueError(f"GEMINI_NUM_PROC_PER_NODE={raw}: at least 1 process per node")
    return size


def local_env(env: Mapping[str, str], local_rank: int, local_world: int) -> dict[str, str]:
    """The environment of local process ``local_rank``: torchrun's variables for its rank."""
    node = int(env.get("GEMINI_RANK") or env.get("NODE_RANK") or "0")
    nodes = int(env.get("GEMINI_WORLD_SIZE") or env.get("PET_NNODES") or "1")
    return {
        **env,
        "RANK": str(node * local_world + local_rank),
        "WORLD_SIZE": str(nodes * local_world),
        "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(local_world),
        "NODE_RANK": str(node),
        "GROUP_RANK": str(node),
    }


def relay_output(proc: subprocess.Popen[bytes], prefix: bytes, lock: threading.Lock,
                 out: IO[bytes] | None = None, tail: deque[bytes] | None = None,
                 source: IO[bytes] | None = None) -> threading.Thread:
    """Copy the child's output lines (``source``, default its stdout) to ``out`` (the
    launcher's stdout), each prefixed; the last lines also to ``tail`` (for the message of a
    failure)."""
    sink = out or sys.stdout.buffer

    def copy() -> None:
        lines = source or proc.stdout
        assert lines is not None
        for line in lines:
            if tail is not None:
                tail.append(line[-1000:])
            with lock:
                sink.write(prefix + line)
                sink.flush()

    thread = threading.Thread(target=copy, name=f"relay-{proc.pid}", daemon=True)
    thread.start()
    return thread


class LocalGroup:
    """P child processes (each in a session of its own) behaving like one ``Popen``."""

    def __init__(self, procs: list[subprocess.Popen[bytes]], grace_s: float) -> None:
        if not procs:
            raise ValueError("a local group needs at least one process")
        self.procs = procs
        self.grace_s = grace_s
        self.returncode: int | None = None

    @property
    def pid(self) -> int:
        return self.procs[0].pid

    def poll(self) -> int | None:
        if self.returncode is not None:
            return self.returncode
        codes = [p.poll() for p in self.procs]
        failed = next((c for c in codes if c not in (None, 0)), None)
        if failed is not None:
            self._stop_the_rest()
            self.returncode = failed
        elif all(c == 0 for c in codes):
            self.returncode = 0
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired("local group", timeout or 0.0)
            time.sleep(_POLL_S)
        return code

    def signal_groups(self, sig: signal.Signals) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, sig)

    def _stop_the_rest(self) -> None:
        self.signal_groups(signal.SIGTERM)
        self.signal_groups(signal.SIGCONT)  # a stopped process acts on SIGTERM once continued
        deadline = time.monotonic() + self.grace_s
        while any(p.poll() is None for p in self.procs) and time.monotonic() < deadline:
            time.sleep(_POLL_S)
        self.signal_groups(signal.SIGKILL)
        for proc in self.procs:
            proc.wait()
