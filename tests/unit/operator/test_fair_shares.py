"""Fair shares per namespace (issue 45, item 5): the operator's polls and reconciles are taken
by namespace in turn, none holding every worker, so sixteen slow jobs of one tenant do not
delay a quiet tenant's job. Real threads and event loop; the polls and reconciles are stand-ins
that take as long as a slow job's (half a second each)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from gemini_operator.calls.poller import PollRounds
from gemini_operator.cluster.cache import JobKey
from gemini_operator.core.fairness import FairQueue
from gemini_operator.runtime.metrics import OperatorMetrics
from gemini_operator.runtime.workqueue import WorkQueue

NOISY = [("noisy", f"job-{i}") for i in range(16)]
QUIET: JobKey = ("quiet", "job")
SLOW_S = 0.5


def test_namespaces_take_turns_and_none_runs_more_than_its_share() -> None:
    queue: FairQueue[str, JobKey] = FairQueue(per_group=2)
    for key in [("a", "1"), ("a", "2"), ("a", "3"), ("b", "1"), ("c", "1")]:
        assert queue.add(key[0], key)
    assert not queue.add("a", ("a", "1"))  # waits once
    taken = [queue.take() for _ in range(5)]
    assert [t[1] if t else None for t in taken] == [
        ("a", "1"), ("b", "1"), ("c", "1"), ("a", "2"), None]  # a holds its two
    queue.done("a")
    assert queue.take() == ("a", ("a", "3"))
    assert queue.take() is None and len(queue) == 0
    with pytest.raises(ValueError):
        FairQueue(0)


async def test_a_quiet_namespaces_polls_keep_their_pace_beside_sixteen_slow_jobs() -> None:
    polls: dict[JobKey, list[float]] = {}

    def poll(key: JobKey) -> bool:
        polls.setdefault(key, []).append(time.monotonic())
        if key != QUIET:
            threading.Event().wait(SLOW_S)
        return False

    rounds = PollRounds(poll, lambda key: None, workers=4)
    started = time.monotonic()
    try:
        for _ in range(8):  # a round every 0.25 s for 2 s, as the operator's poll loop
            rounds.start([*NOISY, QUIET])
            await asyncio.sleep(0.25)
    finally:
        rounds.close()
    quiet = polls.get(QUIET, [])
    first = quiet[0] - started if quiet else float("inf")
    print(f"quiet job beside 16 slow ones: first poll after {first:.3f} s, "
          f"{len(quiet)} polls in 2 s (8 rounds)")
    assert first < 0.2  # first come, first served: after the sixteen, 2 s
    assert len(quiet) >= 6  # first come, first served: 0 or 1


async def test_a_quiet_namespaces_reconcile_starts_at_once_beside_sixteen_slow_ones() -> None:
    began: dict[JobKey, float] = {}

    def reconcile(key: JobKey) -> float | None:
        began[key] = time.monotonic()
        if key != QUIET:
            time.sleep(SLOW_S)
        return None

    queue = WorkQueue(reconcile, lambda: True, OperatorMetrics(), workers=4)
    queue.start()
    try:
        for key in NOISY:
            queue.add(key)
        await asyncio.sleep(0.05)  # the noisy ones hold the workers
        added = time.monotonic()
        queue.add(QUIET)
        deadline = time.monotonic() + 10
        while QUIET not in began and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
    finally:
        await queue.stop()
    latency = began[QUIET] - added
    print(f"quiet job's reconcile beside 16 slow ones: started after {latency:.3f} s")
    assert latency < 0.2  # first come, first served: after four rounds of the sixteen, 2 s
