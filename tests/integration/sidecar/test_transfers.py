"""Transfers run in the background (gemini.control, rule 7): a request waits at most its
wait_seconds and is answered 202 with the progress, a repeat joins the transfer under way
instead of starting another, and a holder that stops answering is left after seconds of
silence, not after a fixed timeout. Real sidecars and their HTTP API on loopback; the holder's
link goes through a relay that paces it or goes dark (the holder's kernel still acknowledges,
as for a stopped process, so only the sidecar's own watch can notice)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from gemini.control.client import ControlClient
from gemini.control.transfers import (
    FetchAnswer,
    FetchRequest,
    PersistAnswer,
    PersistRequest,
    TransferRunning,
)
from gemini_sidecar.app import Sidecar
from gemini_sidecar.fetcher import REPLY_SILENCE_S
from tests.fixtures.s3 import sidecar_settings
from tests.integration.sidecar.conftest import (
    TOKEN,
    free_port,
    make_config,
    payload,
    started,
    write_local,
)
from tests.integration.sidecar.conftest import relay as pipe

pytestmark = pytest.mark.integration
SIZE = 48 << 20
RATE = 16 << 20  # bytes per second through the paced relay: a fetch takes about 3 s


class Relay:
    """A TCP relay to `port` that paces what the holder sends to RATE and, once `dark`, drops
    it (the connection stays open). Counts the connections it carried."""

    def __init__(self, port: int) -> None:
        self.port, self.dark, self.connections = port, False, 0
        self.forwarded = 0
        self.address = ""
        self._server: asyncio.Server | None = None

    async def start(self) -> str:
        """Start; the relay's address as a holder ("host:port")."""
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.address = f"127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self.address

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.port)
        lit = lambda: not self.dark  # noqa: E731
        await asyncio.gather(pipe(reader, up_writer, lit),
                             pipe(up_reader, writer, lit, self._pace))

    async def _pace(self, count: int) -> None:
        self.forwarded += count
        await asyncio.sleep(count / RATE)


@asynccontextmanager
async def owner_and_holder(tmp_path: Path, version: int
                           ) -> AsyncIterator[tuple[Sidecar, Relay, bytes]]:
    """Rank 0 holding `version` in its slot file, rank 1 holding rank 0's replicas, and a
    relay to rank 0's peer port; yields (rank 1, the relay, the version's bytes)."""
    ports = {0: free_port(), 1: free_port()}
    configs = (make_config(0, 2, tmp_path, ports), make_config(1, 2, tmp_path, ports, hold=(0,)))
    async with started(*configs) as (owner, holder):
        data = payload(version, SIZE)
        write_local(owner.cfg, version, data)
        relay_ = Relay(owner.peer_port)
        await relay_.start()
        try:
            yield holder, relay_, data
        finally:
            await relay_.stop()


def api(car: Sidecar) -> ControlClient:
    return ControlClient("127.0.0.1", car.api_port, TOKEN.decode(), timeout=30)


def parts_sent(car: Sidecar) -> float:
    return sum(sample.value for metric in car.metrics.registry.collect()
               for sample in metric.samples if sample.name == "gemini_s3_parts_sent_total")


async def off_loop(call: Callable[[], Any]) -> Any:
    return await asyncio.to_thread(call)


async def until_done(ask: Callable[[], Awaitable[Any]], limit: float = 60) -> tuple[Any, list[Any]]:
    """Ask until the answer is not progress: (the answer, the progress answers before it)."""
    seen: list[Any] = []
    end = time.monotonic() + limit
    while time.monotonic() < end:
        got = await ask()
        if not isinstance(got, TransferRunning):
            return got, seen
        seen.append(got)
    raise AssertionError(f"still running after {limit} s: {seen[-1:]}")


async def test_repeated_fetches_join_the_one_under_way_and_see_its_progress(tmp_path: Path) -> None:
    async with owner_and_holder(tmp_path, 3) as (holder, relay, data):
        client = api(holder)
        request = FetchRequest(0, 3, (relay.address,), "store", wait_seconds=0.2)
        at_once = FetchRequest(0, 3, (relay.address,), "store", 0)
        first = await off_loop(lambda: client.fetch(at_once))
        assert isinstance(first, TransferRunning), first
        answer, progress = await until_done(lambda: off_loop(lambda: client.fetch(request)))
        # asked again after the end (an answer lost): the finished fetch answers
        assert await off_loop(lambda: client.fetch(request)) == answer
        assert relay.connections == 1, "a repeated request started a second fetch"
        holder.store.drop(0)  # what it fetched is gone: the next request fetches again
        assert isinstance(await off_loop(lambda: client.fetch(request)), TransferRunning)
        assert relay.connections == 2
        again, _ = await until_done(lambda: off_loop(lambda: client.fetch(request)))
        assert isinstance(answer, FetchAnswer) and answer.length == SIZE
        assert again == answer
        assert len(progress) >= 3, progress
        assert all(p.total_bytes == SIZE and p.kind == "fetch" and p.version == 3
                   for p in progress if p.total_bytes is not None)
        done = [p.done_bytes for p in progress]
        assert done == sorted(done) and done[-1] > 0, done
        assert not holder.transfers.active(), "a finished transfer was kept"
        assert bytes(holder.store.get(0, 3)[1]) == data


async def test_a_holder_that_goes_silent_is_left_within_seconds_for_the_next(
        tmp_path: Path) -> None:
    async with owner_and_holder(tmp_path, 4) as (holder, relay, data):
        silent, direct = relay.address, f"127.0.0.1:{relay.port}"
        client = api(holder)
        request = FetchRequest(0, 4, (silent, direct), "store", wait_seconds=0.5)
        started_at = time.monotonic()
        assert isinstance(await off_loop(lambda: client.fetch(request)), TransferRunning)
        while relay.forwarded < SIZE // 8:  # part of it came through, then the dark
            await asyncio.sleep(0.05)
        relay.dark = True
        answer, _ = await until_done(lambda: off_loop(lambda: client.fetch(request)))
        took = time.monotonic() - started_at
        assert isinstance(answer, FetchAnswer), answer
        assert answer.holders_used == (silent, direct), answer
        assert took < REPLY_SILENCE_S + 10, f"the silent holder was left after {took:.1f} s"
        assert bytes(holder.store.get(0, 4)[1]) == data


@pytest.mark.s3
async def test_a_persist_is_joined_while_it_uploads_and_answered_again_after(
        tmp_path: Path, s3_server: Any, s3_prefix: str) -> None:
    settings = sidecar_settings(s3_server, s3_prefix, part_bytes=5 << 20, concurrency=1)
    async with started(make_config(0, 1, tmp_path, {0: free_port()}, s3=settings)) as (car,):
        write_local(car.cfg, 7, payload(7, SIZE))
        client = api(car)
        request = PersistRequest(7, wait_seconds=0.1)
        answer, progress = await until_done(lambda: off_loop(lambda: client.persist(request)))
        assert isinstance(answer, PersistAnswer) and answer.bytes == SIZE
        sent = parts_sent(car)
        assert sent == -(-SIZE // (5 << 20)), "a repeated request uploaded parts again"
        assert progress and all(p.kind == "persist" and p.total_bytes == SIZE for p in progress)
        # the answer was lost, say: asked again, the finished upload is answered, not redone
        assert await off_loop(lambda: client.persist(PersistRequest(7))) == answer
        assert parts_sent(car) == sent
