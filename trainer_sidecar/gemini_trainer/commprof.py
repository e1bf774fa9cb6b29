"""Records when the training communicates, so the sidecar can send in the idle spans.

``CommRecorder.install()`` wraps the ``torch.distributed`` collectives and point-to-point ops
(the module attributes, which FSDP2 and DeepSpeed's torch backend call, plus the two functions
DeepSpeed's backend caches at start: its all-gather and reduce-scatter). A synchronous op is
timed from call to return; an asynchronous one (``async_op=True``, ``isend``/``irecv``) from
call to the return of its handle's ``wait()``: that is when the training actually depends on
it. Ops outside an iteration (start-up, restore) are not recorded.

Iterations are delimited by ``iteration_start()``/``iteration_end()`` (the Checkpointer does it
around ``snapshot``). After ``iterations`` of them the profile is written, atomically, to
``<shm dir>/gemini-[<job>-]rank<r>.profile.json`` in the sidecar's format::

    {"iterations": [{"length": s, "ops": [[start, end], ...], "names": [op, ...]}, ...]}

(times in seconds from the iteration's start), and recording stops, as GEMINI profiles a
number of iterations once. Each boundary is also published on a phase board
``gemini-[<job>-]rank<r>.phase`` (struct "<qqq": iteration, phase 1 = running / 0 = between
iterations, unix ns) that the sidecar may poll.
"""

from __future__ import annotations

import functools
import json
import os
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist

OPS = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "broadcast",
    "reduce",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "send",
    "recv",
    "isend",
    "irecv",
    "gather",
    "scatter",
    "all_reduce_coalesced",
    "batch_isend_irecv",
)
ASYNC_ALWAYS = frozenset({"isend", "irecv", "batch_isend_irecv"})
PHASE = struct.Struct("<qqq")


def profile_path(shm_dir: Path, rank: int, job: str = "") -> Path:
    prefix = f"gemini-{job}-" if job else "gemini-"
    return shm_dir / f"{prefix}rank{rank}.profile.json"


def phase_path(shm_dir: Path, rank: int, job: str = "") -> Path:
    prefix = f"gemini-{job}-" if job else "gemini-"
    return shm_dir / f"{prefix}rank{rank}.phase"


class _TimedWork:
    """A collective's handle whose ``wait()`` closes the op's time span."""

    def __init__(self, work: Any, recorder: CommRecorder, name: str, start: float) -> None:
        self._work, self._recorder, self._name, self._start = work, recorder, name, start
        self._done = False

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        result = self._work.wait(*args, **kwargs)
        if not self._done:
            self._done = True
            self._recorder.record(self._name, self._start, self._recorder.clock())
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


class CommRecorder:
    """Per-iteration timeline of communication ops (see the module docstring)."""

    def __init__(
        self,
        output: Path | None,
        iterations: int = 20,
        phase_file: Path | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.output, self.iterations, self.clock = output, iterations, clock
        self.profile: list[dict[str, Any]] = []
        self._ops: list[tuple[str, float, float]] = []
        self._start: float | None = None
        self._index = 0
        self._lock = threading.Lock()
        self._saved: list[tuple[Any, str, Any]] = []
        self._phase_fd = -1
        if phase_file is not None:
            self._phase_fd = os.open(phase_file, os.O_RDWR | os.O_CREAT, 0o644)

    @property
    def installed(self) -> bool:
        return bool(self._saved)

    def install(self) -> CommRecorder:
        if self._saved:
            return self
        c10d = dist.distributed_c10d
        for name in OPS:
            fn = getattr(dist, name, None)
            if fn is None:
                continue
            wrapped = self._wrap(name, fn)
            for owner in (dist, c10d):
                if getattr(owner, name, None) is fn:
                    self._saved.append((owner, name, fn))
                    setattr(owner, name, wrapped)
        self._wrap_deepspeed_backend()
        return self

    def _wrap_deepspeed_backend(self) -> None:
        # DeepSpeed's torch backend keeps its own references to these two functions.
        try:
            from deepspeed.comm import comm as ds_comm  # the module that owns `cdb`
        except Exception:  # DeepSpeed is optional
            return
        backend = getattr(ds_comm, "cdb", None)
        for attr, name in (
            ("all_gather_function", "all_gather_into_tensor"),
            ("reduce_scatter_function", "reduce_scatter_tensor"),
        ):
            fn = getattr(backend, attr, None)
            if fn is not None and not hasattr(fn, "__gemini_wrapped__"):
                self._saved.append((backend, attr, fn))
                setattr(backend, attr, self._wrap(name, fn))

    def uninstall(self) -> None:
        for owner, name, fn in reversed(self._saved):
            setattr(owner, name, fn)
        self._saved.clear()

    def _wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        is_async = name in ASYNC_ALWAYS

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if self._start is None:
                return fn(*args, **kwargs)
            start = self.clock()
            out = fn(*args, **kwargs)
            if out is None or not (is_async or kwargs.get("async_op")):
                self.record(name, start, self.clock())
                return out
            if isinstance(out, list):
                return [_TimedWork(w, self, name, start) for w in out]
            return _TimedWork(out, self, name, start)

        timed.__gemini_wrapped__ = True  # type: ignore[attr-defined]
        return timed

    def record(self, name: str, start: float, end: float) -> None:
        with self._lock:
            if self._start is not None:
                self._ops.append((name, start, end))

    def iteration_start(self) -> None:
        self._start = self.clock() if self.installed else None
        self._ops = []
        self._publish_phase(1)

    def iteration_end(self) -> None:
        self._publish_phase(0)
        if self._start is None:
            return
        end, start = self.clock(), self._start
        with self._lock:
            ops, self._start = sorted(self._ops, key=lambda o: o[1]), None
        self.profile.append(
            {
                "length": end - start,
                "ops": [[s - start, min(e, end) - start] for _, s, e in ops],
                "names": [n for n, _, _ in ops],
            }
        )
        if len(self.profile) >= self.iterations:
            self._write()
            self.uninstall()

    def _publish_phase(self, phase: int) -> None:
        if phase == 1:
            self._index += 1
        if self._phase_fd >= 0:
            os.pwrite(self._phase_fd, PHASE.pack(self._index, phase, time.time_ns()), 0)

    def _write(self) -> None:
        if self.output is None:
            return
        tmp = self.output.with_name(self.output.name + ".tmp")
        tmp.write_text(json.dumps({"iterations": self.profile}))
        os.replace(tmp, self.output)

    def close(self) -> None:
        self.uninstall()
        if self._phase_fd >= 0:
            os.close(self._phase_fd)
            self._phase_fd = -1


def read_phase(path: Path) -> tuple[int, int, int] | None:
    """(iteration, phase, unix ns) from a phase board, or None if there is none yet."""
    try:
        data = path.read_bytes()[: PHASE.size]
    except OSError:
        return None
    if len(data) < PHASE.size:
        return None
    iteration, phase, when = PHASE.unpack(data)
    return int(iteration), int(phase), int(when)
