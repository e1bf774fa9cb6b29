"""The work queue that runs reconciles: a job is queued at most once, a job changed while
being reconciled is reconciled again right after, failures retry with backoff, and nothing runs
unless this replica leads."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from gemini_operator.cluster.cache import JobKey
from gemini_operator.runtime.metrics import OperatorMetrics

log = logging.getLogger(__name__)


class WorkQueue:
    """Coalescing, leader-gated queue of jobs to reconcile, run by asyncio worker tasks."""

    def __init__(
        self, work: Callable[[JobKey], float | None], leads: Callable[[], bool],
        metrics: OperatorMetrics, workers: int = 4,
    ) -> None:
        self._work, self._leads, self._metrics = work, leads, metrics
        self._queue: asyncio.Queue[JobKey] = asyncio.Queue()
        self._queued: set[JobKey] = set()
        self._running: set[JobKey] = set()
        self._dirty: set[JobKey] = set()
        self._failures: dict[JobKey, int] = {}
        self._timers: dict[JobKey, asyncio.TimerHandle] = {}
        self._workers = workers
        self._tasks: list[asyncio.Task[None]] = []
        self._loop: asyncio.AbstractEventLoop | None = None

    def add(self, key: JobKey, delay: float = 0.0) -> None:
        if delay > 0:
            self._later(key, delay)
            return
        if key in self._running:
            self._dirty.add(key)
        elif key not in self._queued:
            self._queued.add(key)
            self._queue.put_nowait(key)

    def add_threadsafe(self, key: JobKey) -> None:
        """`add` from another thread (the queue belongs to the event loop)."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self.add, key)

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._tasks = [asyncio.create_task(self._worker()) for _ in range(self._workers)]

    def workers(self) -> list[asyncio.Task[None]]:
        """The worker tasks (started by `start`): they run until `stop`."""
        return list(self._tasks)

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for timer in self._timers.values():
            timer.cancel()

    def _later(self, key: JobKey, delay: float) -> None:
        existing = self._timers.get(key)
        due = asyncio.get_running_loop().time() + delay
        if existing is not None and existing.when() <= due:
            return
        if existing is not None:
            existing.cancel()
        self._timers[key] = asyncio.get_running_loop().call_later(delay, self._fire, key)

    def _fire(self, key: JobKey) -> None:
        self._timers.pop(key, None)
        self.add(key)

    async def _worker(self) -> None:
        while True:
            key = await self._queue.get()
            self._queued.discard(key)
            if not self._leads():
                continue  # the leader reconciles; on becoming leader every job is queued
            self._running.add(key)
            try:
                requeue = await asyncio.to_thread(self._work, key)
                self._failures.pop(key, None)
                if requeue is not None:
                    self.add(key, max(requeue, 0.05))
            except Exception as err:
                count = self._failures[key] = self._failures.get(key, 0) + 1
                delay = min(0.25 * 2 ** (count - 1), 30.0)
                self._metrics.reconcile_errors.inc()
                log.warning("reconcile of %s/%s failed (retry in %.2fs): %s", *key, delay, err)
                self.add(key, delay)
            finally:
                self._running.discard(key)
                if key in self._dirty:
                    self._dirty.discard(key)
                    self.add(key)

