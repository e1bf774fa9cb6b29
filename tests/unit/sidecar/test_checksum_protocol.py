"""The payload checksum (CRC-32) and the authenticated framing, over a real socket pair."""

from __future__ import annotations

import asyncio
import itertools
import os
import socket
import threading
import zlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gemini_sidecar.checksum import crc32, crc32_combine, crc32_of_pieces
from gemini_sidecar.peer_frames import (
    AuthError,
    ChecksumMismatch,
    Frame,
    FrameType,
    PayloadTampered,
    ProtocolError,
    wire_payload_bytes,
)
from gemini_sidecar.protocol import Channel
from tests.fixtures.tamper import CRC_NEUTRAL, xor_in_place, xor_pattern

TOKEN = b"unit-test-token-0123456789"


def test_crcs_of_pieces_combine_into_the_whole():
    data = os.urandom((1 << 20) + 13)
    cuts = [0, 8, 4096, 777 * 8 + 3, 1 << 19, len(data)]
    pieces = [(crc32(data[a:b]), b - a) for a, b in itertools.pairwise(cuts)]
    assert crc32_of_pieces(pieces) == crc32(data)


def test_any_single_byte_change_and_any_truncation_change_the_checksum():
    data = bytearray(os.urandom(4096))
    reference = crc32(data)
    for pos in (0, 7, 8, 2049, 4095):
        data[pos] ^= 0x40
        assert crc32(data) != reference
        data[pos] ^= 0x40
    assert crc32(data[:-8]) != reference
    assert crc32(bytes(data) + b"\0" * 8) != reference


@settings(max_examples=60, deadline=None)
@given(st.binary(max_size=3000), st.lists(st.integers(0, 3000), max_size=6))
def test_crc32_of_pieces_is_the_crc32_of_their_concatenation(data, cuts):
    bounds = sorted({0, len(data), *(c for c in cuts if c <= len(data))})
    pieces = [(crc32(data[a:b]), b - a) for a, b in itertools.pairwise(bounds)]
    assert crc32_of_pieces(pieces) == zlib.crc32(data)


def test_crc32_combine_over_long_pieces_and_bit_errors_a_word_sum_misses():
    head, tail = os.urandom(1 << 20), os.urandom((3 << 20) + 5)
    assert crc32_combine(crc32(head), crc32(tail), len(tail)) == zlib.crc32(head + tail)
    # bit 5 set in one word and cleared in another: a word sum cannot tell, CRC-32 can
    data = bytearray(16)
    data[0], data[8] = 0x00, 0x20
    flipped = bytearray(data)
    flipped[0], flipped[8] = 0x20, 0x00
    assert _word_sum(data) == _word_sum(flipped)
    assert crc32(data) != crc32(flipped)


def _word_sum(data: bytes | bytearray) -> int:
    """What the data path checked with before CRC-32: the sum of the uint64 words."""
    return int(np.frombuffer(data, dtype="<u8").sum(dtype=np.uint64))


async def _pair(job_server: str = "j", job_client: str = "j", token_client: bytes = TOKEN):
    a, b = socket.socketpair()
    server = Channel(a, TOKEN, 1 << 20, server=True)
    client = Channel(b, token_client, 1 << 20, server=False)
    async def serve() -> None:
        try:
            await server.server_handshake(job_server)
        except ProtocolError:
            server.close()  # what the peer server does on a refusal
            raise

    results = await asyncio.gather(serve(), client.client_handshake(job_client),
                                   return_exceptions=True)
    return server, client, results


async def test_frames_round_trip_with_payloads_verified():
    server, client, results = await _pair()
    assert results == [None, None]
    data = os.urandom(300_000)
    frame = Frame(FrameType.DATA, 3, 9, 64, len(data), crc32(data))
    send = asyncio.create_task(client.send(frame, memoryview(data)))
    got = await server.recv()
    buf = bytearray(got.length)
    crc = await server.recv_into(got, memoryview(buf))
    await send
    assert (got.rank, got.version, got.offset) == (3, 9, 64)
    assert bytes(buf) == data and crc == frame.checksum
    await server.send_error("nope")
    reply = await client.recv()
    assert reply.type == FrameType.ERROR and await client.recv_payload(reply) == b"nope"
    server.close()
    client.close()


async def test_a_replicated_chunk_is_received_with_the_crc32_of_what_landed():
    server, client, _ = await _pair()
    for size in (1000, 700_000):  # in line, and on the bulk threads
        data = os.urandom(size)
        send = asyncio.create_task(
            client.send(Frame(FrameType.PUT_CHUNK, 0, 1, 0, len(data)), data))
        got = await server.recv()
        buf = bytearray(got.length)
        assert await server.recv_crc_into(got, memoryview(buf)) == zlib.crc32(data)
        await send
        assert bytes(buf) == data
    server.close()
    client.close()


async def test_a_payload_that_does_not_match_its_checksum_is_reported():
    server, client, _ = await _pair()
    data = os.urandom(1000)
    await client.send(Frame(FrameType.DATA, 0, 1, 0, len(data), crc32(data) ^ 1), data)
    got = await server.recv()
    with pytest.raises(ChecksumMismatch):
        await server.recv_into(got, memoryview(bytearray(got.length)))
    server.close()
    client.close()


async def test_a_wrong_token_or_another_job_fails_the_handshake():
    for kwargs in ({"token_client": b"another-token-0123456789"}, {"job_client": "other"}):
        _, client, results = await _pair(**kwargs)
        assert isinstance(results[0], AuthError)
        assert isinstance(results[1], ConnectionError)  # connect() turns it into PeerRefused
        client.close()


async def test_oversized_and_replayed_frames_are_refused():
    server, client, _ = await _pair()
    head = client.seal(Frame(FrameType.PUT_CHUNK, 0, 1, 0, 2 << 20, 0))
    await asyncio.get_running_loop().sock_sendall(client.sock, head)
    with pytest.raises(ProtocolError, match="oversized frame"):
        await server.recv()
    server.close()
    client.close()
    server, client, _ = await _pair()
    client._send_seq = 5  # as if frames were dropped or replayed
    await client.send(Frame(FrameType.GET_INFO, 0, 1))
    with pytest.raises(AuthError, match="sequence"):
        await server.recv()
    server.close()
    client.close()


async def test_a_checksum_changed_in_an_authenticated_header_is_refused():
    """The MAC binds the CRC-32 a frame carries: rewriting it on the way is caught."""
    server, client, _ = await _pair()
    a, b = socket.socketpair()  # capture the sealed header instead of sending it
    real, client.sock = client.sock, a
    await client.send(Frame(FrameType.PUT_END, 0, 1, checksum=0x1234ABCD))
    client.sock = real
    head = bytearray(b.recv(1 << 16))
    struct_offset = 4 + 1 + 1 + 2 + 4 + 8 + 8 + 8  # magic, type, flags, pad, rank, version,
    head[struct_offset + 7] ^= 0x01  # offset, length: then the checksum's last byte
    await asyncio.get_running_loop().sock_sendall(real, bytes(head))
    with pytest.raises(AuthError, match="bad frame authentication on PUT_END"):
        await server.recv()
    for s in (a, b):
        s.close()
    server.close()
    client.close()


def test_the_crc_neutral_rewrite_really_keeps_the_crc32():
    data = bytearray(os.urandom(5000))
    before = zlib.crc32(data)
    xor_in_place(data, 1234, CRC_NEUTRAL)
    assert zlib.crc32(data) == before


def _relay(src: socket.socket, dst: socket.socket, rewrite_at: int | None) -> None:
    """Copy src to dst until src closes, XORing CRC_NEUTRAL into the stream at `rewrite_at`."""
    seen = 0
    while data := src.recv(1 << 16):
        data = xor_pattern(data, seen, rewrite_at, CRC_NEUTRAL)
        seen += len(data)
        dst.sendall(data)
    dst.close()


async def _pair_through_rewriter(rewrite_at: int):
    """A handshaken pair whose client-to-server bytes pass a rewriter on the path."""
    server_sock, server_end = socket.socketpair()
    client_sock, client_end = socket.socketpair()
    for args in ((client_end, server_end, rewrite_at), (server_end, client_end, None)):
        threading.Thread(target=_relay, args=args, daemon=True).start()
    server = Channel(server_sock, TOKEN, 4 << 20, server=True)
    client = Channel(client_sock, TOKEN, 4 << 20, server=False)
    await asyncio.gather(server.server_handshake("j"), client.client_handshake("j"))
    return server, client


@pytest.mark.parametrize("size", [1000, 700_000])  # in line, and on the bulk threads
async def test_a_payload_rewritten_on_the_path_with_its_crc32_kept_is_refused(size):
    from gemini_sidecar.peer_frames import HEADER_BYTES, NONCE_BYTES

    hello = HEADER_BYTES + wire_payload_bytes(NONCE_BYTES + 1)
    server, client = await _pair_through_rewriter(hello + HEADER_BYTES + size // 2)
    data = os.urandom(size)
    frame = Frame(FrameType.PUT_CHUNK, 0, 1, 0, len(data), crc32(data))
    send = asyncio.create_task(client.send(frame, data))
    got = await server.recv()
    buf = bytearray(got.length)
    with pytest.raises(PayloadTampered, match="keyed MAC") as refused:
        await server.recv_crc_into(got, memoryview(buf))
    await send
    assert zlib.crc32(buf) == crc32(data) and bytes(buf) != data  # the CRC could not tell
    assert isinstance(refused.value, ChecksumMismatch)  # fetchers refetch it elsewhere
    # the stream is still in step: the next frame arrives intact
    send = asyncio.create_task(
        client.send(Frame(FrameType.PUT_CHUNK, 0, 1, 0, len(data), crc32(data)), data))
    got = await server.recv()
    assert await server.recv_crc_into(got, memoryview(buf)) == crc32(data)
    await send
    assert bytes(buf) == data
    server.close()
    client.close()
