"""Replicated chunks are checked end to end: a chunk changed on the path (even with its
CRC-32 kept, and with encryption on, where CTR lets an on-path XOR through to the plaintext)
fails its keyed MAC and is resent, corruption at rest in the sender's shared memory is never
replicated as a good version."""

from __future__ import annotations

import asyncio
import struct
from functools import partial

import pytest

from gemini.slots.layout import shard_path
from gemini.slots.shard import ShardSlots
from gemini_sidecar.app import Sidecar
from gemini_sidecar.peer_frames import HEADER_BYTES, FrameType, wire_payload_bytes
from tests.fixtures.tamper import CRC_NEUTRAL, xor_in_place
from tests.integration.sidecar.conftest import (
    free_port,
    make_config,
    payload,
    relay,
    replica_complete,
    wait_for,
    write_local,
)

pytestmark = pytest.mark.integration
_LENGTH_AT = 4 + 1 + 1 + 2 + 4 + 8 + 8  # ">4sBBHIQQ..." : magic, type, flags, pad, rank, ...


class _FlipFirstChunk:
    """Forwards client -> holder, changing the first PUT_CHUNK payload it sees at `at`: one
    bit flipped, or a CRC-32-neutral pattern XORed in (the holder's replies go back
    untouched)."""

    def __init__(self, target: int, at: int, pattern: bytes = b"\x08") -> None:
        self.target, self.at, self.pattern, self.flipped = target, at, pattern, 0

    async def _client_to_server(self, reader: asyncio.StreamReader,
                                writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readexactly(HEADER_BYTES)
                length = struct.unpack_from(">Q", head, _LENGTH_AT)[0]
                body = bytearray(await reader.readexactly(wire_payload_bytes(length)))
                if head[4] == FrameType.PUT_CHUNK and length > self.at + 8 and not self.flipped:
                    xor_in_place(body, self.at, self.pattern)
                    self.flipped += 1
                writer.write(head + body)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def handle(self, client_r: asyncio.StreamReader,
                     client_w: asyncio.StreamWriter) -> None:
        server_r, server_w = await asyncio.open_connection("127.0.0.1", self.target)
        await asyncio.gather(self._client_to_server(client_r, server_w),
                             relay(server_r, client_w))


@pytest.mark.parametrize("encrypt", [False, True], ids=["plain", "encrypted"])
@pytest.mark.parametrize("pattern", [b"\x08", CRC_NEUTRAL], ids=["bit-flip", "crc32-kept"])
async def test_a_chunk_changed_on_the_way_is_caught_by_its_mac_and_resent(tmp_path, caplog,
                                                                          pattern, encrypt):
    a_port, b_port = free_port(), free_port()
    b = Sidecar(make_config(1, 2, tmp_path, {0: a_port, 1: b_port}, hold=(0,),
                            peer_encryption=encrypt))
    await b.start()
    flipper = _FlipFirstChunk(b.peer_port, 123_457, pattern)
    proxy = await asyncio.start_server(flipper.handle, "127.0.0.1", 0)
    proxy_port = proxy.sockets[0].getsockname()[1]
    a = Sidecar(make_config(0, 2, tmp_path, {0: a_port, 1: proxy_port}, send_to=(1,),
                            peer_encryption=encrypt))
    await a.start()
    try:
        data = payload(4, 3 * (1 << 20) + 40)  # four chunks of 1 MiB (the last one short)
        info = write_local(a.cfg, 4, data)
        a.notify(4, None)
        await wait_for(partial(replica_complete, b, 0, 4), what="v4 complete at rank 1")
        assert flipper.flipped == 1, "the proxy corrupted nothing"
        assert bytes(b.store.get(0, 4)[1]) == data
        assert b.store.get(0, 4)[0].checksum == info.checksum
        assert "resending" in caplog.text and "failed its keyed MAC" in caplog.text
        assert "127.0.0.1:" in caplog.text  # the refusal names the peer
        # the holder completes the version before its acknowledgement reaches the sender
        await wait_for(lambda: a.replicator.status.peers[1].acked_version == 4,
                       what="v4 acknowledged to rank 0")
    finally:
        await a.stop()
        await b.stop()
        proxy.close()


async def test_bytes_corrupt_at_rest_in_the_senders_shm_are_never_a_complete_replica(tmp_path):
    ports = {0: free_port(), 1: free_port()}
    a = Sidecar(make_config(0, 2, tmp_path, ports, send_to=(1,)))
    b = Sidecar(make_config(1, 2, tmp_path, ports, hold=(0,)))
    await a.start()
    await b.start()
    try:
        write_local(a.cfg, 1, payload(1, 2 << 20))
        path = shard_path(0, a.cfg.shm_dir, a.cfg.job)
        with ShardSlots(path) as slots:  # flip a payload byte behind the slot header's CRC
            info = slots.latest_complete()
            assert info is not None
            at = slots._payload_offset(info.index) + 5000
        with open(path, "r+b") as f:
            f.seek(at)
            byte = f.read(1)
            f.seek(at)
            f.write(bytes([byte[0] ^ 0x01]))
        a.notify(1, None)
        peer = a.replicator.status.peers
        await wait_for(lambda: 1 in peer and peer[1].last_error != "", what="refusal")
        assert "do not match the trainer's CRC-32" in peer[1].last_error
        assert peer[1].acked_version == -1
        assert not any(r.complete for r in b.store.inventory())
    finally:
        await a.stop()
        await b.stop()
