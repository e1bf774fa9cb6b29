"""Per-rank writes (issue 14): a holder accepts rank R's replica only from rank R's address,
so a pod holding the job token cannot overwrite another rank's replica. In-process holder on
loopback; the senders connect from 127.0.0.1 and 127.0.0.2 (both on `lo`)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from gemini_sidecar.checksum import crc32
from gemini_sidecar.config import PeerAddress, make_placement
from gemini_sidecar.peer_client import _reply, _send_chunks, connect, even_plan, send_version
from gemini_sidecar.peer_frames import FLAG_COMPLETE, Frame, FrameType, PeerRefused
from gemini_sidecar.senders import plain_ip
from tests.integration.sidecar.conftest import JOB, TOKEN, free_port, make_config, payload, started

pytestmark = pytest.mark.integration
SIZE = (1 << 20) + 64


async def _send_from(source: str, holder, rank: int, version: int, data: bytes) -> None:
    chan = await connect(PeerAddress("127.0.0.1", holder.peer_port), JOB, TOKEN, 1 << 30,
                         source=source)
    try:
        view = memoryview(data)
        await send_version(chan, rank, version, view, crc32(view), even_plan(len(data), 1 << 20),
                           lambda: True)
    finally:
        chan.close()


def _holder_config(tmp_path, check_senders: bool = True):
    ports = {0: free_port(), 1: free_port(), 2: free_port()}
    cfg = make_config(1, 3, tmp_path, ports, hold=(0, 2), check_senders=check_senders)
    peers = {0: PeerAddress("127.0.0.1", ports[0]), 1: PeerAddress("127.0.0.1", ports[1]),
             2: PeerAddress("127.0.0.2", ports[2])}  # rank 2 lives at 127.0.0.2
    return replace(cfg, placement=make_placement(peers, (0, 2), (), 1, 3))


async def test_a_rank_writes_its_own_shard_and_no_other(tmp_path, caplog):
    async with started(_holder_config(tmp_path)) as (holder,):
        await _send_from("127.0.0.1", holder, 0, 1, payload(1, SIZE))  # rank 0, from rank 0
        with pytest.raises(PeerRefused, match=r"may only come from rank 2 at 127\.0\.0\.2"):
            await _send_from("127.0.0.1", holder, 2, 1, payload(2, SIZE))  # rank 0 posing as 2
        assert [r.rank for r in holder.store.inventory() if r.complete] == [0]
        await _send_from("127.0.0.2", holder, 2, 1, payload(3, SIZE))  # rank 2 itself
        assert bytes(holder.store.get(2, 1)[1]) == payload(3, SIZE)
        with pytest.raises(PeerRefused, match="may only come from rank 0"):
            await _send_from("127.0.0.2", holder, 0, 2, payload(4, SIZE))  # 2 posing as 0
        assert holder.store.get(0, None)[0].version == 1  # rank 0's replica untouched
    assert "refused 127.0.0.1:" in caplog.text and "not from 127.0.0.1" in caplog.text


async def test_the_check_can_be_turned_off(tmp_path):
    async with started(_holder_config(tmp_path, check_senders=False)) as (holder,):
        await _send_from("127.0.0.1", holder, 2, 1, payload(2, SIZE))
        assert bytes(holder.store.get(2, 1)[1]) == payload(2, SIZE)


def test_addresses_compare_as_plain_ips():
    assert plain_ip("::ffff:10.1.2.3") == "10.1.2.3"
    assert plain_ip("[fd00::1]") == "fd00::1"
    assert plain_ip("worker-0.job.ns.svc") == "worker-0.job.ns.svc"


async def test_a_transfer_is_written_only_on_the_connection_that_began_it(tmp_path, caplog):
    """Issue 45, item 2: rank 2 begins a version and goes quiet; another pod of the job (it
    holds the token) cannot write its chunks or complete it. The owner then finishes it."""
    data, poison = payload(5, SIZE), payload(6, SIZE)
    plan = even_plan(SIZE, 1 << 20)
    async with started(_holder_config(tmp_path)) as (holder,):
        address = PeerAddress("127.0.0.1", holder.peer_port)
        owner = await connect(address, JOB, TOKEN, 1 << 30, source="127.0.0.2")
        attacker = await connect(address, JOB, TOKEN, 1 << 30, source="127.0.0.1")
        try:
            await owner.send(Frame(FrameType.PUT_BEGIN, 2, 1, total=SIZE,
                                   checksum=crc32(data)))
            assert (await _reply(owner)).type == FrameType.ACK
            with pytest.raises(PeerRefused, match="not begun on this connection"):
                await _send_chunks(attacker, 2, 1, memoryview(poison), plan, {}, 8)
            await attacker.send(Frame(FrameType.PUT_END, 2, 1, checksum=crc32(poison)))
            with pytest.raises(PeerRefused, match="not begun on this connection"):
                await _reply(attacker)
            assert not [r for r in holder.store.inventory() if r.rank == 2 and r.complete]
            received: dict[int, int] = {}
            await _send_chunks(owner, 2, 1, memoryview(data), plan, received, 8)
            await owner.send(Frame(FrameType.PUT_END, 2, 1, checksum=crc32(data)))
            assert (await _reply(owner)).flags & FLAG_COMPLETE
            assert bytes(holder.store.get(2, 1)[1]) == data
        finally:
            owner.close()
            attacker.close()
    assert "not begun on this connection" in caplog.text
