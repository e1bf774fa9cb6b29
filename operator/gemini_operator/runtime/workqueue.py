"""The work queue that runs reconciles: a job is queued at most once, a job changed while
being reconciled is reconciled again right after, failures retry with backoff, nothing runs
unless this replica leads, and namespaces take turns for the workers (core.fairness), none
holding more than `workers - 1` of them: one tenant's many jobs, or jobs whose reconciles are
slow (stuck in recovery), cannot hold another tenant's reconciles back."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from gemini_operator.cluster.cache import JobKey
from gemini_operator.core.fairness import FairQueue
from gemini_operator.runtime.metrics import OperatorMetrics

log = logging.getLogger(__name__)


class WorkQueue:
    """Coalescing, leader-gated queue of jobs to reconcile, run by asyncio worker tasks."""

    def __init__(
        self, work: Callable[[JobKey], float | None], leads: Callable[[], bool],
        metrics: OperatorMetrics, workers: int = 5,
    ) -> None:
        self._work, self._leads, self._metrics = work, leads, metrics
        self._waiting: FairQueue[str, JobKey] = FairQueue(max(1, workers - 1))
        self._ready = asyncio.Event()  # set while a waiting job may be taken
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
        elif self._waiting.add(key[0], key):
            self._ready.set()

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

    async def _next(self) -> JobKey:
        """The next job whose namespace may run one more reconcile now."""
        while True:
            taken = self._waiting.take()
            if taken is not None:
                return taken[1]
            self._ready.clear()
            await self._ready.wait()

    async def _worker(self) -> None:
        while True:
            key = await self._next()
            if not self._leads():
                self._waiting.done(key[0])
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
                self._waiting.done(key[0])
                self._ready.set()  # a job of this namespace may run now
                if key in self._dirty:
                    self._dirty.discard(key)
                    self.add(key)

