"""Authenticated peers that misbehave (issue 14, item 7) cannot cost a holder its complete
replicas, memory outside its budget, or the bulk transfers of everyone else; a frame left
unfinished ends its connection at the read timeout. In-process sidecars on loopback, driven
over real sockets by the sidecar's own client."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from gemini_sidecar.checksum import crc32
from gemini_sidecar.config import PeerAddress, ServerLimits
from gemini_sidecar.peer_client import connect, even_plan, send_version
from gemini_sidecar.peer_frames import Frame, FrameType
from gemini_sidecar.protocol import Channel
from gemini_sidecar.store import FREE_RECORDS, RECORD_BYTES
from tests.integration.sidecar.conftest import (
    free_port,
    make_config,
    payload,
    started,
    wait_for,
    write_local,
)
from tests.integration.sidecar.hostile import closed_by_peer, fetch_bytes

pytestmark = pytest.mark.integration
SIZE = (1 << 20) + 64


async def _peer(car, cfg) -> Channel:
    """An authenticated connection to `car`'s peer server, as any sidecar of the job opens."""
    return await connect(PeerAddress("127.0.0.1", car.peer_port), cfg.job, cfg.auth_token,
                         cfg.max_frame_bytes)


async def _replicate(chan: Channel, rank: int, version: int, data: bytes) -> None:
    view = memoryview(data)
    await send_version(chan, rank, version, view, crc32(view), even_plan(len(data), 1 << 20),
                       lambda: True)


async def _reply(chan: Channel) -> Frame:
    reply = await asyncio.wait_for(chan.recv(), 10)
    await chan.discard(reply.length)
    return reply


async def test_begins_with_no_data_after_them_never_drop_the_complete_copies(tmp_path):
    ports = {0: free_port(), 1: free_port()}
    cfg = make_config(0, 2, tmp_path, ports)
    async with started(make_config(1, 2, tmp_path, ports, hold=(0,))) as (holder,):
        v4, v5 = payload(4, SIZE), payload(5, SIZE)
        chan = await _peer(holder, cfg)
        try:
            await _replicate(chan, 0, 4, v4)
            await _replicate(chan, 0, 5, v5)
            for version in (5, 4, 3, 5, 4):  # begun, never sent
                await chan.send(Frame(FrameType.PUT_BEGIN, 0, version, total=SIZE, checksum=7))
                assert (await _reply(chan)).type == FrameType.ACK
        finally:
            chan.close()
        complete = [(r.version, r.complete) for r in holder.store.inventory() if r.complete]
        assert complete == [(4, True)]  # the newest copy older than every begin stays
        got, data = await fetch_bytes(cfg, 0, 4, PeerAddress("127.0.0.1", holder.peer_port))
        assert (got.version, data) == (4, v4)


async def test_tiny_chunks_are_refused_once_their_records_reach_the_memory_budget(tmp_path):
    ports = {0: free_port(), 1: free_port()}
    cfg = make_config(0, 2, tmp_path, ports)
    budget = SIZE + 100 * RECORD_BYTES  # one version and room for 100 chunk records
    async with started(make_config(1, 2, tmp_path, ports, hold=(0,), budget=budget)) as (
            holder,):
        chan = await _peer(holder, cfg)
        try:
            await chan.send(Frame(FrameType.PUT_BEGIN, 0, 1, total=SIZE, checksum=0))
            assert (await _reply(chan)).type == FrameType.ACK
            sent = FREE_RECORDS + 300
            for i in range(sent):  # 8 bytes at each of `sent` distinct offsets
                await chan.send(Frame(FrameType.PUT_CHUNK, 0, 1, offset=8 * i, length=8),
                                bytes(8))
            replies = [(await _reply(chan)).type for _ in range(sent)]
        finally:
            chan.close()
        first_refusal = replies.index(FrameType.ERROR)
        assert first_refusal == FREE_RECORDS + 100, first_refusal
        assert set(replies[first_refusal:]) == {FrameType.ERROR}
        assert holder.store.used_bytes <= budget
        assert holder.store.inventory()[0].received_bytes == 8 * first_refusal


async def test_stalled_chunk_receivers_do_not_block_other_peers_transfers(tmp_path):
    """64 authenticated peers each start a 1 MiB chunk and stall: a replication and a fetch
    from the same holder still go through (each connection has its own worker threads)."""
    world, stalled_peers = 70, 64
    ports = {r: free_port() for r in range(world)}
    cfg = make_config(0, world, tmp_path, ports)
    limits = ServerLimits(max_connections=100, max_connections_per_host=100)
    holder_cfg = make_config(1, world, tmp_path, ports, hold=(0, *range(2, 2 + stalled_peers)),
                             limits=limits)
    async with started(holder_cfg) as (holder,):
        own = payload(11, SIZE)
        write_local(holder.cfg, 11, own)
        stalls = []
        try:
            for rank in range(2, 2 + stalled_peers):
                chan = await _peer(holder, cfg)
                stalls.append(chan)
                await chan.send(Frame(FrameType.PUT_BEGIN, rank, 1, total=1 << 20))
                assert (await _reply(chan)).type == FrameType.ACK
                head = chan.seal(Frame(FrameType.PUT_CHUNK, rank, 1, 0, 1 << 20))
                await asyncio.get_running_loop().sock_sendall(chan.sock, head + bytes(1000))
            await asyncio.sleep(1.0)  # every one of them is in its receive now
            started_at = time.monotonic()
            sender = await _peer(holder, cfg)
            try:
                data = payload(12, 3 * SIZE)
                await asyncio.wait_for(_replicate(sender, 0, 12, data), 10)
            finally:
                sender.close()
            assert bytes(holder.store.get(0, 12)[1]) == data
            _, fetched = await asyncio.wait_for(
                fetch_bytes(cfg, 1, 11, PeerAddress("127.0.0.1", holder.peer_port)), 10)
            assert fetched == own
            assert time.monotonic() - started_at < 10
        finally:
            for chan in stalls:
                chan.close()


async def test_a_frame_left_unfinished_ends_its_connection_at_the_read_timeout(
        tmp_path, caplog):
    caplog.set_level(logging.WARNING)
    ports = {0: free_port(), 1: free_port()}
    cfg = make_config(0, 2, tmp_path, ports)
    limits = ServerLimits(read_timeout_s=1.0)
    async with started(make_config(1, 2, tmp_path, ports, hold=(0,), limits=limits)) as (
            holder,):
        chan = await _peer(holder, cfg)
        try:
            head = chan.seal(Frame(FrameType.GET_INFO, 0, 1))
            await asyncio.get_running_loop().sock_sendall(chan.sock, head[:20])
            chan.sock.setblocking(True)
            assert await asyncio.to_thread(closed_by_peer, chan.sock, 5)
        finally:
            chan.close()
        await wait_for(lambda: holder.listener_health()["peer"].connections == 0, 5)
    assert any("did not arrive within 1 s (GEMINI_READ_TIMEOUT_S)" in r.getMessage()
               and "refused 127.0.0.1:" in r.getMessage() for r in caplog.records)
