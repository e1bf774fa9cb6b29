"""PollRounds: every job polled side by side, a job still in its last poll skipped (it holds
one thread at most), a poll that raises logged without stopping the others, and the jobs whose
findings changed handed back on the event loop."""

from __future__ import annotations

import asyncio
import logging
import threading

import pytest

from gemini_operator.calls.poller import PollRounds
from gemini_operator.cluster.cache import JobKey

STUCK, CHANGED, SAME, BROKEN = ("ns", "stuck"), ("ns", "changed"), ("ns", "same"), ("ns", "x")


async def test_a_job_in_its_last_poll_is_skipped_while_the_others_are_polled_each_round(
        caplog: pytest.LogCaptureFixture) -> None:
    release = threading.Event()
    polled: list[JobKey] = []
    changed: list[tuple[JobKey, bool]] = []
    loop_thread = threading.get_ident()

    def poll(key: JobKey) -> bool:
        polled.append(key)
        if key == STUCK:
            release.wait(10)
        if key == BROKEN:
            raise KeyError("version")
        return key in (CHANGED, STUCK)

    rounds = PollRounds(poll, lambda key: changed.append(
        (key, threading.get_ident() == loop_thread)), workers=4)
    try:
        for _ in range(3):
            rounds.start([STUCK, CHANGED, SAME, BROKEN])
            await asyncio.sleep(0.1)
        release.set()
        await asyncio.sleep(0.1)
    finally:
        rounds.close()
    assert polled.count(STUCK) == 1
    assert [polled.count(k) for k in (CHANGED, SAME, BROKEN)] == [3, 3, 3]
    assert changed.count((CHANGED, True)) == 3 and (STUCK, True) in changed
    assert all(on_loop for _, on_loop in changed) and (SAME, True) not in changed
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == ["polling ns/x failed: 'version'"] * 3


async def test_every_poll_is_timed_also_one_that_fails() -> None:
    durations: list[float] = []

    def poll(key: JobKey) -> bool:
        if key == BROKEN:
            raise KeyError("version")
        threading.Event().wait(0.05)
        return False

    rounds = PollRounds(poll, lambda key: None, observe=durations.append)
    try:
        rounds.start([SAME, BROKEN])
        await asyncio.sleep(0.3)
    finally:
        rounds.close()
    assert len(durations) == 2 and max(durations) >= 0.05


async def test_a_job_asked_again_while_being_polled_is_polled_once_more_right_after() -> None:
    """A failure hint during a poll that may have read the workers before the failure."""
    release = threading.Event()
    polled: list[JobKey] = []

    def poll(key: JobKey) -> bool:
        polled.append(key)
        if len(polled) == 1:
            release.wait(10)
        return False

    rounds = PollRounds(poll, lambda key: None)
    try:
        rounds.start([SAME])
        await asyncio.sleep(0.05)
        rounds.start([SAME])  # a regular round: skipped, not repeated
        rounds.start([SAME], again=True)
        rounds.start([SAME], again=True)  # asked twice: still one more poll
        assert polled == [SAME]
        release.set()
        await asyncio.sleep(0.2)
        assert polled == [SAME, SAME]
        rounds.start([SAME])  # nothing left over: polled as usual
        await asyncio.sleep(0.2)
    finally:
        rounds.close()
    assert polled == [SAME, SAME, SAME]
