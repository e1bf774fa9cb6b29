"""Transfers that outlive the request that started them (gemini.control, rule 7).

A fetch, refill, persist or restore runs as a task of its own, keyed by what it moves (kind,
rank, version, target): a request for a key already running joins it instead of starting a
second copy, and waits for it at most the time it asked for. Its progress (bytes done of the
total) is counted by the transfer as the bytes land, from any thread. A failed transfer's
error reaches the requests waiting at that moment, or, when none was (a caller that polls
between short waits), the next request for its key within KEEP_SECONDS; then it is
forgotten and the request after starts again. Without that, the poll after a failure would
start the transfer over and could answer with a later, misleading error (a persist retried
after its slot was reused says "not in the slot file", not why the upload failed). A
finished one is kept for KEEP_SECONDS and answers a request for its
key while its result still holds (the caller says how to check: the slot or replica it
wrote is still there), so a caller that polls does not start the transfer over when it ended
between two polls.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from gemini.control.transfers import TransferRunning

T = TypeVar("T")
KEEP_SECONDS = 60.0


@dataclass
class Progress:
    """Bytes done of the total, updated by the transfer (event loop or worker threads)."""

    total_bytes: int | None = None
    done_bytes: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, count: int) -> None:
        with self._lock:
            self.done_bytes += count

    def expect(self, count: int) -> None:
        """`count` more bytes are to come (a refill learns each rank's size in turn)."""
        with self._lock:
            self.total_bytes = (self.total_bytes or 0) + count


@dataclass
class Transfer(Generic[T]):
    kind: str
    rank: int | None
    version: int | None
    task: asyncio.Task[T]
    progress: Progress
    holds: Callable[[T], bool]  # whether a finished transfer's result is still true
    started: float = field(default_factory=time.monotonic)
    ended: float | None = None
    waiting: int = 0  # requests in `outcome` now
    failure_told: bool = False  # a request got its error

    def failed(self) -> bool:
        return self.task.done() and (self.task.cancelled() or self.task.exception() is not None)

    def answers(self, now: float) -> bool:
        """Whether this transfer answers a new request for its key: running, or finished
        well within KEEP_SECONDS with a result that still holds."""
        if not self.task.done():
            return True
        if self.ended is None or now - self.ended > KEEP_SECONDS or self.task.cancelled():
            return False
        if self.task.exception() is not None:
            return not self.failure_told  # its error still has to reach a request
        return self.holds(self.task.result())

    def running(self) -> TransferRunning:
        total, done = self.progress.total_bytes, self.progress.done_bytes
        if total is not None:  # a chunk fetched again (corrupt) counts twice
            done = min(done, total)
        return TransferRunning(self.kind, self.rank, self.version, done, total,
                               round(time.monotonic() - self.started, 3))


class Transfers:
    """The transfers of one sidecar, by key."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._by_key: dict[Hashable, Transfer[Any]] = {}
        self._clock = clock

    def start_or_join(self, key: Hashable, kind: str, rank: int | None, version: int | None,
                      run: Callable[[Progress], Awaitable[T]],
                      holds: Callable[[T], bool] = lambda _: True) -> Transfer[T]:
        """The transfer for `key` (running, or finished and still true by `holds`), or a new
        one running `run(progress)`."""
        now = self._clock()
        self._by_key = {k: t for k, t in self._by_key.items() if t.answers(now)}
        found = self._by_key.get(key)
        if found is not None:
            return found
        progress = Progress()
        task: asyncio.Task[T] = asyncio.ensure_future(run(progress))
        transfer = Transfer(kind, rank, version, task, progress, holds)
        self._by_key[key] = transfer
        task.add_done_callback(lambda _: self._ended(key, transfer))
        return transfer

    def _ended(self, key: Hashable, transfer: Transfer[Any]) -> None:
        transfer.ended = self._clock()
        told = transfer.waiting > 0 or transfer.task.cancelled()  # waiters get it next
        if transfer.failed() and told and self._by_key.get(key) is transfer:
            transfer.failure_told = True
            del self._by_key[key]  # the next request starts again

    def active(self) -> list[TransferRunning]:
        """The transfers running now."""
        return [t.running() for t in self._by_key.values() if not t.task.done()]

    async def stop(self) -> None:
        tasks = [t.task for t in self._by_key.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def outcome(transfer: Transfer[T], wait_seconds: float | None) -> T | TransferRunning:
    """The transfer's result (or its error raised) once it ends, or what it has done so far
    if `wait_seconds` pass first. Leaving (the caller's request cancelled) never cancels it."""
    transfer.waiting += 1
    try:
        done, _ = await asyncio.wait({transfer.task}, timeout=wait_seconds)
    finally:
        transfer.waiting -= 1
    if not done:
        return transfer.running()
    if transfer.failed():
        transfer.failure_told = True  # the next request starts again
    return transfer.task.result()
