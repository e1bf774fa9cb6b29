"""Real sidecars on loopback driven with gemini.control's client: every answer parses as the
contract's type, bad bodies are refused naming the field, and the placement-first rule holds."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable
from typing import TypeVar

import pytest

from gemini.control.client import ControlClient, ControlError
from gemini.control.messages import (
    Health,
    NotifyAnswer,
    NotifyRequest,
    Peers,
    ProfileAnswer,
    ProfileIteration,
    ProfileRequest,
)
from gemini.control.transfers import FetchReplicasRequest, FetchRequest
from gemini_sidecar.app import Sidecar
from tests.integration.sidecar.conftest import (
    TOKEN,
    free_port,
    make_config,
    payload,
    replica_complete,
    wait_for,
    write_local,
)

pytestmark = pytest.mark.integration
SIZE = (1 << 20) + 8
T = TypeVar("T")


async def _off_loop(call: Callable[[], T]) -> T:
    """The client blocks; the sidecars serve on this event loop."""
    return await asyncio.to_thread(call)


async def test_real_sidecars_answer_the_contracts_types(tmp_path) -> None:
    ports = {0: free_port(), 1: free_port()}
    cars = [Sidecar(make_config(0, 2, tmp_path, ports, hold=(1,), send_to=(1,))),
            Sidecar(make_config(1, 2, tmp_path, ports, hold=(0,), send_to=(0,)))]
    for car in cars:
        await car.start()
    try:
        client = [ControlClient("127.0.0.1", c.api_port, TOKEN.decode(), timeout=30)
                  for c in cars]
        assert await _off_loop(client[0].healthz) == Health("ok")
        info = write_local(cars[0].cfg, 3, payload(3, SIZE))
        notice = NotifyRequest(3, 0.01, rank=0, checksum=info.checksum)
        assert await _off_loop(lambda: client[0].notify(notice)) == NotifyAnswer(3)
        await wait_for(lambda: replica_complete(cars[1], 0, 3), what="replica of rank 0")
        await wait_for(lambda: cars[0].replicator.status.peers[1].acked_version == 3,
                       what="the replica's acknowledgement")

        inventory = await _off_loop(client[1].inventory)
        assert (inventory.job, inventory.rank, inventory.world_size) == ("job-a", 1, 2)
        assert [(c.rank, c.version, c.complete, c.bytes) for c in inventory.replicas] == [
            (0, 3, True, SIZE)]
        assert inventory.placement == Peers({0: f"127.0.0.1:{ports[0]}",
                                             1: f"127.0.0.1:{ports[1]}"}, (0,), (0,))
        sender = await _off_loop(client[0].inventory)
        assert sender.complete_versions() == {3}
        assert sender.sending.peers[1].acked_version == 3

        got = await _off_loop(lambda: client[1].fetch(FetchRequest(0, 3, (0,), "store")))
        assert (got.rank, got.version, got.length) == (0, 3, SIZE)
        assert got.checksum == info.checksum
        refill = await _off_loop(lambda: client[1].fetch_replicas(FetchReplicasRequest()))
        assert refill.ok and [(r.rank, r.version) for r in refill.replicas] == [(0, 3)]

        profile = ProfileRequest((ProfileIteration(0.5, ((0.0, 0.1),)),))
        assert await _off_loop(lambda: client[0].profile(profile)) == ProfileAnswer(1)
    finally:
        for car in cars:
            await car.stop()


async def test_bad_bodies_and_calls_out_of_order_are_refused_with_the_reason(tmp_path) -> None:
    ports = {0: free_port(), 1: free_port()}
    car = Sidecar(make_config(1, 2, tmp_path, ports, hold=(0,)))
    await car.start()
    try:
        client = ControlClient("127.0.0.1", car.api_port, TOKEN.decode(), timeout=30)
        with pytest.raises(ControlError) as err:
            await _off_loop(lambda: client.call_json("/fetch", {"rank": "0"}))
        assert err.value.status == 400
        assert err.value.detail == "/fetch body: 'rank' must be an integer >= 0, got '0' (str)"

        # the operator re-places: rank 1 holds nobody and knows no peer address now
        placed = await _off_loop(lambda: client.peers(Peers({}, (), ())))
        assert placed == Peers({}, (), ())
        # so a fetch naming its holder by rank must wait for a placement (rule 1)
        with pytest.raises(ControlError) as err:
            await _off_loop(lambda: client.fetch(FetchRequest(0, 3, (0,), "store")))
        assert err.value.status == 400 and err.value.detail is not None
        assert "POST /peers first" in err.value.detail
        with pytest.raises(ControlError) as err:
            await _off_loop(lambda: client.peers(Peers({}, (), (5,))))
        assert err.value.detail is not None and "outside the world" in err.value.detail
        unauthorized = ControlClient("127.0.0.1", car.api_port, "wrong", timeout=30)
        with pytest.raises(ControlError) as err:
            await _off_loop(unauthorized.inventory)
        assert err.value.status == 401
    finally:
        await car.stop()


async def test_the_inventory_carries_the_trainers_heartbeat(tmp_path) -> None:
    """The operator's poll reads progress from here instead of calling the launcher too."""
    beat = tmp_path / "heartbeat"
    cfg = dataclasses.replace(make_config(0, 1, tmp_path, {0: free_port()}), heartbeat_file=beat)
    car = Sidecar(cfg)
    await car.start()
    try:
        client = ControlClient("127.0.0.1", car.api_port, TOKEN.decode(), timeout=30)
        before = await _off_loop(client.inventory)
        assert before.heartbeat and before.progress is None  # no step yet
        beat.write_text(f"17 {time.time() - 2.0}\n")
        after = await _off_loop(client.inventory)
        assert after.progress is not None and after.progress.step == 17
        assert 1.5 < after.progress.age_s < 30
    finally:
        await car.stop()
