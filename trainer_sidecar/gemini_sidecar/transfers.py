"""Transfers that outlive the request that started them (gemini.control, rule 7).

A fetch, refill, persist or restore runs as a task of its own, keyed by what it moves (kind,
rank, version, target): a request for a key already running joins it instead of starting a
second copy, and waits for it at most the time it asked for. Its progress (bytes done of the
total) is counted by the transfer as the bytes land, from any thread. A finished transfer is
forgotten: its error reaches the requests waiting at that moment, and the next request starts
again (a restart of a finished fetch or restore is correct, only slower; a finished persist
is answered from the sidecar's note of it).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from gemini.control import TransferRunning

T = TypeVar("T")


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
    started: float = field(default_factory=time.monotonic)

    def running(self) -> TransferRunning:
        total, done = self.progress.total_bytes, self.progress.done_bytes
        if total is not None:  # a chunk fetched again (corrupt) counts twice
            done = min(done, total)
        return TransferRunning(self.kind, self.rank, self.version, done, total,
                               round(time.monotonic() - self.started, 3))


class Transfers:
    """The transfers of one sidecar, by key."""

    def __init__(self) -> None:
        self._running: dict[Hashable, Transfer[Any]] = {}

    def start_or_join(self, key: Hashable, kind: str, rank: int | None, version: int | None,
                      run: Callable[[Progress], Awaitable[T]]) -> Transfer[T]:
        """The transfer running for `key`, or a new one running `run(progress)`."""
        found = self._running.get(key)
        if found is not None:
            return found
        progress = Progress()
        task: asyncio.Task[T] = asyncio.ensure_future(run(progress))
        transfer = Transfer(kind, rank, version, task, progress)
        self._running[key] = transfer
        task.add_done_callback(lambda _: self._forget(key, transfer))
        return transfer

    def _forget(self, key: Hashable, transfer: Transfer[Any]) -> None:
        if self._running.get(key) is transfer:
            del self._running[key]
        if not transfer.task.cancelled():
            transfer.task.exception()  # seen here: its waiters (if any) are answered with it

    def active(self) -> list[TransferRunning]:
        return [t.running() for t in self._running.values()]

    async def stop(self) -> None:
        tasks = [t.task for t in self._running.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def outcome(transfer: Transfer[T], wait_seconds: float | None) -> T | TransferRunning:
    """The transfer's result (or its error raised) once it ends, or what it has done so far
    if `wait_seconds` pass first. Leaving (the caller's request cancelled) never cancels it."""
    done, _ = await asyncio.wait({transfer.task}, timeout=wait_seconds)
    if not done:
        return transfer.running()
    return transfer.task.result()
