"""Peer encryption (GEMINI_PEER_ENCRYPTION=on): replicas and fetches between real sidecars
cross the wire with no run of their bytes in the clear (the same recorder sees them plainly
when encryption is off), arrive intact, and a sidecar that requires encryption turns away a
peer that does not encrypt, saying why."""

from __future__ import annotations

import asyncio
from functools import partial

import pytest

from gemini_sidecar.app import Sidecar
from gemini_sidecar.config import PeerAddress
from tests.integration.sidecar.conftest import (
    free_port,
    make_config,
    payload,
    read_local,
    replica_complete,
    wait_for,
    write_local,
)

pytestmark = pytest.mark.integration
VERSION = 4
SIZE = 3 * (1 << 20) + 40  # a bulk payload and a short tail
SAMPLE_BYTES = 32


class _Recorder:
    """A TCP proxy to `target` keeping a copy of what went each way."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.sent = bytearray()  # client -> server
        self.answered = bytearray()  # server -> client

    async def _copy(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter,
                    record: bytearray) -> None:
        try:
            while data := await src.read(1 << 16):
                record += data
                dst.write(data)
                await dst.drain()
        except ConnectionError:
            pass
        finally:
            dst.close()

    async def handle(self, client_r: asyncio.StreamReader,
                     client_w: asyncio.StreamWriter) -> None:
        server_r, server_w = await asyncio.open_connection("127.0.0.1", self.target)
        await asyncio.gather(self._copy(client_r, server_w, self.sent),
                             self._copy(server_r, client_w, self.answered))


def _leaked(data: bytes, wire: bytes) -> int:
    """How many of 64 samples of `data` (32 bytes each, spread over it) appear on the wire."""
    step = (len(data) - SAMPLE_BYTES) // 64
    return sum(data[at : at + SAMPLE_BYTES] in wire for at in range(0, 64 * step, step))


@pytest.mark.parametrize("encrypt", [True, False], ids=["encrypted", "plain"])
async def test_replicas_and_fetches_cross_the_wire_encrypted_and_arrive_intact(tmp_path, encrypt):
    a_port, b_port = free_port(), free_port()
    b = Sidecar(make_config(1, 2, tmp_path, {0: a_port, 1: b_port}, hold=(0,),
                            peer_encryption=encrypt))
    await b.start()
    recorder = _Recorder(b.peer_port)
    proxy = await asyncio.start_server(recorder.handle, "127.0.0.1", 0)
    proxy_port = proxy.sockets[0].getsockname()[1]
    a = Sidecar(make_config(0, 2, tmp_path, {0: a_port, 1: proxy_port}, send_to=(1,),
                            peer_encryption=encrypt))
    await a.start()
    try:
        data = payload(VERSION, SIZE)
        write_local(a.cfg, VERSION, data)
        a.notify(VERSION, None)
        await wait_for(partial(replica_complete, b, 0, VERSION), what="the replica at rank 1")
        assert bytes(b.store.get(0, VERSION)[1]) == data
        assert len(recorder.sent) > SIZE  # it did go through the recorder
        assert _leaked(data, bytes(recorder.sent)) == (0 if encrypt else 64)

        # a replacement of rank 0 fetches its shard back from rank 1, through the recorder
        fresh = Sidecar(make_config(0, 2, tmp_path / "fresh", {0: free_port(), 1: proxy_port},
                                    peer_encryption=encrypt))
        await fresh.start()
        try:
            got = await fresh.pulls.fetch(0, VERSION, [PeerAddress("127.0.0.1", proxy_port)], "shm")
            assert (got.version, got.length) == (VERSION, SIZE)
            assert read_local(fresh.cfg, VERSION) == data
        finally:
            await fresh.stop()
        assert len(recorder.answered) > SIZE
        assert _leaked(data, bytes(recorder.answered)) == (0 if encrypt else 64)
    finally:
        await a.stop()
        await b.stop()
        proxy.close()


async def test_a_sidecar_requiring_encryption_refuses_a_peer_that_does_not_encrypt(tmp_path,
                                                                                   caplog):
    ports = {0: free_port(), 1: free_port()}
    a = Sidecar(make_config(0, 2, tmp_path, ports, send_to=(1,)))
    b = Sidecar(make_config(1, 2, tmp_path, ports, hold=(0,), peer_encryption=True))
    await a.start()
    await b.start()
    try:
        write_local(a.cfg, 1, payload(1, 1 << 20))
        a.notify(1, None)
        peer = a.replicator.status.peers
        await wait_for(lambda: 1 in peer and peer[1].last_error != "", what="the refusal")
        assert "takes only encrypted peer traffic" in peer[1].last_error
        assert "GEMINI_PEER_ENCRYPTION=on" in peer[1].last_error
        assert peer[1].acked_version == -1
        assert not b.store.inventory()
        assert "refused a peer that does not encrypt" in caplog.text
        assert "127.0.0.1:" in caplog.text  # the refusal names the peer
    finally:
        await a.stop()
        await b.stop()


async def test_a_sidecar_without_the_setting_still_takes_an_encrypting_peer(tmp_path):
    ports = {0: free_port(), 1: free_port()}
    a = Sidecar(make_config(0, 2, tmp_path, ports, send_to=(1,), peer_encryption=True))
    b = Sidecar(make_config(1, 2, tmp_path, ports, hold=(0,)))
    await a.start()
    await b.start()
    try:
        data = payload(2, 1 << 20)
        write_local(a.cfg, 2, data)
        a.notify(2, None)
        await wait_for(partial(replica_complete, b, 0, 2), what="the replica at rank 1")
        assert bytes(b.store.get(0, 2)[1]) == data
    finally:
        await a.stop()
        await b.stop()
