"""A replacement sidecar fetches its rank from the holders; corruption is caught and healed."""

from __future__ import annotations

import asyncio
import shutil
from functools import partial

import pytest

from gemini_sidecar.app import Sidecar
from gemini_sidecar.config import PeerAddress, make_placement
from tests.fixtures.tamper import CRC_NEUTRAL, xor_pattern
from tests.integration.sidecar.conftest import (
    free_port,
    make_config,
    payload,
    read_local,
    wait_for,
    write_local,
)

pytestmark = pytest.mark.integration
SIZE = 3 * (1 << 20) + 24
VERSION = 5


async def _three_with_rank0_replicated(tmp_path) -> tuple[list[Sidecar], bytes]:
    ports = {r: free_port() for r in range(3)}
    cars = [
        Sidecar(make_config(0, 3, tmp_path, ports, send_to=(1, 2))),
        Sidecar(make_config(1, 3, tmp_path, ports, hold=(0,))),
        Sidecar(make_config(2, 3, tmp_path, ports, hold=(0,))),
    ]
    for car in cars:
        await car.start()
    data = payload(VERSION, SIZE)
    write_local(cars[0].cfg, VERSION, data)
    cars[0].notify(VERSION, None)
    for holder in cars[1:]:
        await wait_for(partial(_has, holder, 0, VERSION), what="replicas")
    return cars, data


def _has(sidecar: Sidecar, rank: int, version: int) -> bool:
    return any(r.rank == rank and r.version == version and r.complete
               for r in sidecar.store.inventory())


async def _replace_rank0(cars: list[Sidecar], tmp_path) -> Sidecar:
    """Kill rank 0's sidecar and its memory, start a fresh one on the same port."""
    old = cars[0]
    await old.stop()
    shutil.rmtree(old.cfg.shm_dir)
    ports = {r: c.peer_port for r, c in enumerate(cars)}
    fresh = Sidecar(make_config(0, 3, tmp_path, ports, hold=(1,)))
    await fresh.start()
    cars[0] = fresh
    return fresh


def _fetch_failures(sidecar: Sidecar) -> float:
    text = sidecar.metrics.render().decode()
    line = next(x for x in text.splitlines() if x.startswith("gemini_fetch_failures_total{"))
    return float(line.rsplit(" ", 1)[1])


async def test_replacement_fetches_its_shard_from_a_holder_then_repulls_its_replicas(tmp_path):
    cars, data = await _three_with_rank0_replicated(tmp_path)
    try:
        fresh = await _replace_rank0(cars, tmp_path)
        result = await fresh.pulls.fetch(0, VERSION, fresh.pulls.holders_for(0, [1, 2]), "shm")
        assert (result.version, result.length) == (VERSION, SIZE)
        assert result.holders_used == (str(cars[1].placement.peers[1]),)
        assert read_local(fresh.cfg, VERSION) == data
        # and it holds rank 1 again: pulled from rank 1's own shared memory
        rank1 = payload(99, SIZE - 8)
        write_local(cars[1].cfg, 9, rank1)
        await fresh.pulls.fetch(1, None, fresh.pulls.holders_for(1, None), "store")
        assert bytes(fresh.store.get(1, 9)[1]) == rank1
    finally:
        for car in cars:
            await car.stop()


async def test_corruption_at_rest_in_one_holder_is_caught_and_fetched_from_another(tmp_path):
    cars, data = await _three_with_rank0_replicated(tmp_path)
    try:
        _, view = cars[1].store.get(0, VERSION)
        view[12345] ^= 0xFF  # a bit flip in rank 1's copy of rank 0
        fresh = await _replace_rank0(cars, tmp_path)
        result = await fresh.pulls.fetch(0, VERSION, fresh.pulls.holders_for(0, [1, 2]), "shm")
        assert result.holders_used == (str(cars[2].placement.peers[2]),)
        assert read_local(fresh.cfg, VERSION) == data
        assert _fetch_failures(fresh) >= 1
    finally:
        for car in cars:
            await car.stop()


async def _corrupting_proxy(target: int, flip_at: int,
                            pattern: bytes = b"\x01") -> tuple[asyncio.Server, int]:
    """Forward to 127.0.0.1:target, XORing `pattern` into the reply stream at `flip_at`."""

    async def pipe(reader, writer, flip: int | None) -> None:
        seen = 0
        try:
            while chunk := await reader.read(1 << 16):
                chunk = xor_pattern(chunk, seen, flip, pattern)
                seen += len(chunk)
                writer.write(chunk)
                await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()

    async def handle(client_r, client_w) -> None:
        server_r, server_w = await asyncio.open_connection("127.0.0.1", target)
        await asyncio.gather(pipe(client_r, server_w, None), pipe(server_r, client_w, flip_at))

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


@pytest.mark.parametrize("pattern", [b"\x01", CRC_NEUTRAL], ids=["bit-flip", "crc32-kept"])
async def test_a_chunk_corrupted_in_transit_is_refetched_from_another_holder(tmp_path, pattern):
    cars, data = await _three_with_rank0_replicated(tmp_path)
    # challenge (20) + WELCOME + INFO + DATA headers (92 each), then the first chunk's payload
    proxy, proxy_port = await _corrupting_proxy(cars[1].peer_port, 20 + 3 * 92 + 1000,
                                                pattern)
    try:
        fresh = await _replace_rank0(cars, tmp_path)
        bad_holder = f"127.0.0.1:{proxy_port}"
        holders = fresh.pulls.holders_for(0, [bad_holder, 2])
        result = await fresh.pulls.fetch(0, VERSION, holders, "shm")
        assert result.holders_used == (bad_holder, str(PeerAddress("127.0.0.1", cars[2].peer_port)))
        assert read_local(fresh.cfg, VERSION) == data
        assert _fetch_failures(fresh) >= 1
    finally:
        proxy.close()
        for car in cars:
            await car.stop()


async def test_placement_update_drops_replicas_no_longer_held(tmp_path):
    cars, _ = await _three_with_rank0_replicated(tmp_path)
    try:
        holder = cars[2]
        peers = dict(holder.placement.peers)
        holder.set_placement(make_placement(peers, (), (0,), 2, 3))
        assert holder.store.inventory() == []
        assert holder.store.used_bytes == 0
    finally:
        for car in cars:
            await car.stop()
