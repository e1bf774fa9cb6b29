"""Sidecar calls that run off the reconcile path.

A reconcile must never wait on a sidecar: one that accepted the connection but is still
starting, or one on a cut-off node, holds a request for its whole timeout, and a failure the
API shows meanwhile would wait behind it (the operator acts on failures within a second).
`BackgroundCalls` runs such a call in a thread, one per job at a time; the reconcile that
started it returns at once, and the call's end wakes the job, whose next reconcile takes the
result.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from gemini_operator.cluster.cache import JobKey


@dataclass(frozen=True)
class Running:
    """The call for this job is still in flight."""


@dataclass(frozen=True)
class Finished:
    """The call ended: what it returned, or `error`, what it raised."""

    value: Any = None
    error: BaseException | None = None


class BackgroundCalls:
    """At most one call per job in flight; a result belongs to the input (`what`) it was
    started for, so a result for an input that changed since is dropped, never applied."""

    def __init__(self, wake: Callable[[JobKey], None] | None = None) -> None:
        self.wake = wake or (lambda key: None)
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="sidecar-call")
        self._calls: dict[JobKey, tuple[str, Future[Any]]] = {}

    def start(self, key: JobKey, what: str, call: Callable[[], Any]) -> None:
        future = self._pool.submit(call)
        self._calls[key] = (what, future)
        future.add_done_callback(lambda _: self.wake(key))

    def take(self, key: JobKey, what: str) -> Running | Finished | None:
        """The state of the call started for `what`: Running, Finished (then forgotten), or
        None when there is none (never started, taken already, or started for another input)."""
        entry = self._calls.get(key)
        if entry is None:
            return None
        started_for, future = entry
        if started_for != what:
            del self._calls[key]  # its input changed: whatever it returns is stale
            return None
        if not future.done():
            return Running()
        del self._calls[key]
        error = future.exception()
        return Finished(error=error) if error is not None else Finished(value=future.result())

    def forget(self, key: JobKey) -> None:
        self._calls.pop(key, None)
