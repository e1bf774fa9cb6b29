"""The transfer registry (gemini_sidecar.transfers): joins, keeps a finished result only
while it holds and for KEEP_SECONDS, tells a failure once (to its waiters, or else to the
next request) and then starts again, never cancels for a waiter."""

from __future__ import annotations

import asyncio

import pytest

from gemini.control.transfers import TransferRunning
from gemini_sidecar.transfers import KEEP_SECONDS, Progress, Transfers, outcome


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


async def test_a_request_joins_the_running_transfer_and_sees_its_progress() -> None:
    transfers, gate, starts = Transfers(), asyncio.Event(), []

    async def run(progress: Progress) -> str:
        starts.append(progress)
        progress.expect(10)
        progress.add(4)
        await gate.wait()
        return "done"

    first = transfers.start_or_join("k", "fetch", 1, 7, run)
    running = await outcome(first, 0.05)
    assert isinstance(running, TransferRunning)
    assert (running.done_bytes, running.total_bytes, running.rank) == (4, 10, 1)
    assert transfers.start_or_join("k", "fetch", 1, 7, run) is first
    gate.set()
    assert await outcome(first, None) == "done"
    assert len(starts) == 1


async def test_a_finished_result_answers_while_it_holds_and_not_after_keep_seconds() -> None:
    clock, holds = Clock(), {"yes": True}
    transfers = Transfers(clock)
    runs: list[int] = []

    async def run(_: Progress) -> int:
        runs.append(1)
        return len(runs)

    def again() -> object:  # the object, not its id: a freed one's id is reused
        return transfers.start_or_join("k", "restore", 0, 3, run, lambda _: holds["yes"])

    first = again()
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert again() is first and len(runs) == 1
    holds["yes"] = False  # the slot it wrote was reused: start over
    assert again() is not first
    await asyncio.sleep(0.01)
    holds["yes"] = True
    second = again()
    clock.now += KEEP_SECONDS + 1
    assert again() is not second


async def test_a_failure_reaches_its_waiters_and_the_next_request_starts_again() -> None:
    transfers = Transfers()
    calls: list[int] = []

    async def fails(_: Progress) -> None:
        calls.append(1)
        raise OSError("holder gone")

    transfer = transfers.start_or_join("k", "fetch", 0, 1, fails)
    with pytest.raises(OSError, match="holder gone"):
        await outcome(transfer, 1.0)
    transfers.start_or_join("k", "fetch", 0, 1, fails)
    await asyncio.sleep(0.01)
    assert len(calls) == 2


async def test_a_failure_no_request_waited_for_reaches_the_next_request_once() -> None:
    """A poller between two short waits: the transfer fails while no request waits, so the
    next request gets that error (not a second run's), and the one after starts again."""
    clock = Clock()
    transfers = Transfers(clock)
    errors = iter(["S3 refused the connection", "version 2 not in the slot file"])
    calls: list[int] = []

    async def fails(_: Progress) -> None:
        calls.append(1)
        await asyncio.sleep(0.02)
        raise OSError(next(errors))

    running = await outcome(transfers.start_or_join("k", "persist", 0, 2, fails), 0.001)
    assert isinstance(running, TransferRunning)
    await asyncio.sleep(0.05)  # it failed meanwhile
    with pytest.raises(OSError, match="S3 refused"):
        await outcome(transfers.start_or_join("k", "persist", 0, 2, fails), 1.0)
    assert len(calls) == 1
    with pytest.raises(OSError, match="not in the slot file"):
        await outcome(transfers.start_or_join("k", "persist", 0, 2, fails), 1.0)
    assert len(calls) == 2


async def test_an_untold_failure_is_forgotten_after_keep_seconds() -> None:
    clock = Clock()
    transfers = Transfers(clock)
    calls: list[int] = []

    async def fails(_: Progress) -> None:
        calls.append(1)
        raise OSError("gone")

    first = transfers.start_or_join("k", "persist", 0, 2, fails)
    await asyncio.sleep(0.01)
    clock.now += KEEP_SECONDS + 1
    assert transfers.start_or_join("k", "persist", 0, 2, fails) is not first
    await asyncio.sleep(0.01)
    assert len(calls) == 2


async def test_a_waiter_leaving_does_not_cancel_the_transfer() -> None:
    transfers, gate = Transfers(), asyncio.Event()

    async def run(_: Progress) -> str:
        await gate.wait()
        return "done"

    transfer = transfers.start_or_join("k", "persist", 0, 1, run)
    waiter = asyncio.ensure_future(outcome(transfer, None))
    await asyncio.sleep(0.01)
    waiter.cancel()
    gate.set()
    assert await outcome(transfer, 1.0) == "done"
