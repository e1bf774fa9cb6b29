"""Two and three sidecars on loopback: replication, checksums, fetch, refusals, budget."""

from __future__ import annotations

import asyncio
from functools import partial

import pytest

from gemini_sidecar.app import Sidecar
from gemini_sidecar.checksum import crc32
from gemini_sidecar.config import PeerAddress, make_placement
from gemini_sidecar.pacing import profile_from_json
from gemini_sidecar.peer_client import REPLY_TIMEOUT_S, FetchFailed, connect
from gemini_sidecar.peer_frames import (
    CHALLENGE_BYTES,
    HEADER_BYTES,
    Frame,
    FrameType,
    PeerRefused,
    ProtocolError,
)
from tests.integration.sidecar.conftest import (
    JOB,
    TOKEN,
    free_port,
    make_config,
    payload,
    relay,
    replica_complete,
    wait_for,
    write_local,
)

pytestmark = pytest.mark.integration


async def test_new_local_version_is_replicated_bit_exactly_with_two_versions_kept(tmp_path):
    ports = {0: free_port(), 1: free_port()}
    a = Sidecar(make_config(0, 2, tmp_path, ports, send_to=(1,)))
    b = Sidecar(make_config(1, 2, tmp_path, ports, hold=(0,)))
    await a.start()
    await b.start()
    try:
        for version in (1, 2, 3):
            data = payload(version, 3 * (1 << 20) + 13)
            info = write_local(a.cfg, version, data)
            a.notify(version, 0.01)
            await wait_for(partial(replica_complete, b, 0, version), what=f"v{version} at rank 1")
            replica, view = b.store.get(0, version)
            assert bytes(view) == data
            assert replica.checksum == info.checksum
        versions = {(r.version, r.complete) for r in b.store.inventory()}
        assert versions == {(2, True), (3, True)}
        assert a.replicator.status.peers[1].acked_version == 3
    finally:
        await a.stop()
        await b.stop()


async def _raw_exchange(port: int, data: bytes) -> bytes:
    """Connect, read the challenge, send `data`, return whatever comes back before close."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        await reader.readexactly(CHALLENGE_BYTES)
        writer.write(data)
        await writer.drain()
        return await asyncio.wait_for(reader.read(), 10)
    except ConnectionResetError:  # closed with our bytes unread: refused as well
        return b""
    finally:
        writer.close()


async def test_bad_peers_are_refused_and_logged_while_the_sidecar_keeps_serving(tmp_path, caplog):
    ports = {0: free_port(), 1: free_port()}
    a = Sidecar(make_config(0, 2, tmp_path, ports, send_to=(1,)))
    b = Sidecar(make_config(1, 2, tmp_path, ports, hold=(0,), max_frame_bytes=2 << 20))
    await a.start()
    await b.start()
    addr = PeerAddress("127.0.0.1", b.peer_port)
    try:
        # unauthenticated garbage, then a well-formed HELLO without the right token
        assert await _raw_exchange(b.peer_port, b"GET / HTTP/1.1\r\n" * 20) == b""
        with pytest.raises(PeerRefused):
            await connect(addr, JOB, b"not-the-job-token-at-all-xx", 1 << 20)
        with pytest.raises(PeerRefused):  # another job, with its own token
            await connect(addr, "job-b", b"job-b-secret-token-0123456789", 1 << 20)
        # authenticated, then an oversized frame
        chan = await connect(addr, JOB, TOKEN, 1 << 30)
        await chan.send(Frame(FrameType.PUT_CHUNK, 0, 1, 0, 64 << 20, 0))
        with pytest.raises((ConnectionError, ProtocolError)):
            await chan.recv()
        chan.close()
        # authenticated, then a malformed frame (bad magic, not even a header)
        chan = await connect(addr, JOB, TOKEN, 1 << 30)
        await asyncio.get_running_loop().sock_sendall(chan.sock, b"\x00" * HEADER_BYTES)
        with pytest.raises((ConnectionError, ProtocolError)):
            await chan.recv()
        chan.close()
        await wait_for(lambda: _refused(b) >= 5, what="five refusals counted")
        assert "another job" not in caplog.text or "job-b" in caplog.text
        assert "oversized frame" in caplog.text
        assert "bad frame magic" in caplog.text
        # still serving the legitimate peer
        data = payload(7, 5 << 20)
        write_local(a.cfg, 7, data)
        a.notify(7, None)
        await wait_for(lambda: replica_complete(b, 0, 7), what="replication after refusals")
        assert bytes(b.store.get(0, 7)[1]) == data
    finally:
        await a.stop()
        await b.stop()


def _refused(sidecar: Sidecar) -> float:
    for metric in sidecar.metrics.registry.collect():
        if metric.name == "gemini_peer_refused":
            return sum(s.value for s in metric.samples if s.name.endswith("_total"))
    return 0.0


async def test_a_version_over_the_memory_budget_is_refused_and_the_last_one_kept(tmp_path):
    size = 3 << 20
    ports = {0: free_port(), 1: free_port()}
    a = Sidecar(make_config(0, 2, tmp_path, ports, send_to=(1,)))
    b = Sidecar(make_config(1, 2, tmp_path, ports, hold=(0,), budget=size + size // 2))
    await a.start()
    await b.start()
    try:
        first = payload(1, size)
        write_local(a.cfg, 1, first)
        a.notify(1, None)
        await wait_for(lambda: replica_complete(b, 0, 1), what="v1")
        write_local(a.cfg, 2, payload(2, size))
        a.notify(2, None)
        await wait_for(lambda: a.replicator.status.peers[1].last_error != "", what="refusal")
        assert "over its budget" in a.replicator.status.peers[1].last_error
        assert [(r.version, r.complete) for r in b.store.inventory()] == [(1, True)]
        assert bytes(b.store.get(0, 1)[1]) == first
        assert b.store.used_bytes <= b.cfg.memory_budget_bytes
        body = b.metrics.render().decode()
        assert ('gemini_memory_budget_refusals_total{geminijob="job-a",'
                'geminijob_namespace="default",rank="1"} 1.0') in body
    finally:
        await a.stop()
        await b.stop()


async def test_a_half_sent_version_is_never_complete_and_the_previous_one_stays(
    tmp_path, caplog
):
    ports = {0: free_port(), 1: free_port()}
    a = Sidecar(make_config(0, 2, tmp_path, ports, send_to=(1,)))
    b = Sidecar(make_config(1, 2, tmp_path, ports, hold=(0,)))
    await a.start()
    await b.start()
    try:
        first = payload(1, 2 << 20)
        write_local(a.cfg, 1, first)
        a.notify(1, None)
        await wait_for(partial(replica_complete, b, 0, 1), what="v1")
        # the sender dies after half of version 2
        second = payload(2, 2 << 20)
        chan = await connect(PeerAddress("127.0.0.1", b.peer_port), JOB, TOKEN, 1 << 30)
        await chan.send(Frame(FrameType.PUT_BEGIN, 0, 2, total=len(second), checksum=0))
        await chan.recv()
        half = second[: 1 << 20]
        await chan.send(Frame(FrameType.PUT_CHUNK, 0, 2, 0, len(half), crc32(half)), half)
        await chan.recv()
        chan.close()
        inv = {(r.version, r.complete, r.received_bytes) for r in b.store.inventory()}
        assert inv == {(1, True, 2 << 20), (2, False, 1 << 20)}
        assert b.store.get(0)[0].version == 1 and bytes(b.store.get(0)[1]) == first
        with pytest.raises(FetchFailed, match="could not fetch rank 0 version 2"):
            await b.pulls.fetch(0, 2, [PeerAddress("127.0.0.1", b.peer_port)], "store")
        assert "rank 0 version 2 is not complete here" in caplog.text
        assert bytes(b.store.get(0)[1]) == first
    finally:
        await a.stop()
        await b.stop()


class _Freezer:
    """Relays to a holder until frozen, then swallows every byte both ways and closes
    nothing: to the sender, a peer cut off by a network partition."""

    def __init__(self, target: int) -> None:
        self.target, self.frozen = target, False

    async def handle(self, client_r: asyncio.StreamReader,
                     client_w: asyncio.StreamWriter) -> None:
        server_r, server_w = await asyncio.open_connection("127.0.0.1", self.target)
        await asyncio.gather(relay(client_r, server_w, self._flowing),
                             relay(server_r, client_w, self._flowing))

    def _flowing(self) -> bool:
        return not self.frozen


async def test_a_send_stuck_on_a_cut_off_peer_is_resent_to_the_new_one_on_a_placement_change(
    tmp_path,
):
    ports = {0: free_port(), 1: free_port()}
    b = Sidecar(make_config(1, 2, tmp_path, ports, hold=(0,)))
    await b.start()
    freezer = _Freezer(b.peer_port)
    proxy = await asyncio.start_server(freezer.handle, "127.0.0.1", 0)
    proxy_port = proxy.sockets[0].getsockname()[1]
    a = Sidecar(make_config(0, 2, tmp_path, {**ports, 1: proxy_port}, send_to=(1,)))
    c = Sidecar(make_config(1, 2, tmp_path / "c", {0: ports[0], 1: free_port()}, hold=(0,)))
    await a.start()
    await c.start()
    try:
        write_local(a.cfg, 1, payload(1, 2 << 20))
        a.notify(1, None)
        await wait_for(partial(replica_complete, b, 0, 1), what="v1 at the first rank 1")
        freezer.frozen = True  # rank 1's node is cut off while version 2 is on its way
        second = payload(2, 2 << 20)
        write_local(a.cfg, 2, second)
        a.notify(2, None)
        await wait_for(lambda: a.replicator.status.peers[1].sending_version == 2, what="v2 sent")
        await asyncio.sleep(0.5)
        # The operator replaces rank 1 and delivers the new placement.
        started = asyncio.get_running_loop().time()
        peers = {0: PeerAddress("127.0.0.1", ports[0]), 1: PeerAddress("127.0.0.1", c.peer_port)}
        a.set_placement(make_placement(peers, (), (1,), 0, 2))
        await wait_for(partial(replica_complete, c, 0, 2), timeout=10, what="v2 at the new rank 1")
        assert asyncio.get_running_loop().time() - started < REPLY_TIMEOUT_S / 10
        assert bytes(c.store.get(0, 2)[1]) == second
        write_local(a.cfg, 3, payload(3, 2 << 20))
        a.notify(3, None)
        await wait_for(partial(replica_complete, c, 0, 3), what="v3 at the new rank 1")
        assert a.replicator.status.skipped_versions == 0
    finally:
        for car in (a, b, c):
            await car.stop()
        proxy.close()


async def test_interleaved_mode_sends_in_the_profiled_idle_spans(tmp_path):
    ports = {0: free_port(), 1: free_port()}
    a = Sidecar(make_config(0, 2, tmp_path, ports, send_to=(1,), traffic_mode="interleaved"))
    b = Sidecar(make_config(1, 2, tmp_path, ports, hold=(0,)))
    a.pushed_profile = profile_from_json({"iterations": [
        {"length": 0.5, "ops": [[0.0, 0.2], [0.3, 0.4]]}] * 3})
    await a.start()
    await b.start()
    try:
        data = payload(3, 4 << 20)
        write_local(a.cfg, 3, data)
        started = asyncio.get_running_loop().time()
        a.notify(3, None)
        await wait_for(partial(replica_complete, b, 0, 3), what="interleaved replication")
        assert asyncio.get_running_loop().time() - started >= 0.2  # waited for the first gap
        assert bytes(b.store.get(0, 3)[1]) == data
        status = a.replicator.status
        assert status.fits_idle_spans and status.interval_iterations == 1
        assert "fit the idle spans" in status.plan_reason
    finally:
        await a.stop()
        await b.stop()
