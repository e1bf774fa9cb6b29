"""Peer client: send a shard version to a holder (chunked, paced, pipelined) and fetch one.

Replies on a connection come in request order, so the client matches them first-in
first-out and keeps up to `window` chunks in flight: while the peer copies one chunk out of its
socket buffer, the next ones are already on the wire. Integrity: see send_version.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from gemini_sidecar.checksum import crc32
from gemini_sidecar.config import PeerAddress
from gemini_sidecar.peer_bulk import BULK_TIMEOUT_S
from gemini_sidecar.peer_frames import (
    FLAG_COMPLETE,
    FLAG_CORRUPT,
    Frame,
    FrameType,
    PeerRefused,
    ProtocolError,
)
from gemini_sidecar.protocol import Channel

log = logging.getLogger(__name__)
CONNECT_TIMEOUT_S = 10.0
REPLY_TIMEOUT_S = 120.0
RESEND_ROUNDS = 2


class SourceChanged(Exception):
    """The local slot was reused by the trainer while it was being sent; the send is void."""


class FetchFailed(Exception):
    """No holder could deliver the version intact."""


@dataclass(frozen=True)
class PlannedChunk:
    offset: int  # multiple of 8
    length: int
    delay_s: float  # earliest send time, seconds after the send started


async def connect(addr: PeerAddress, job: str, token: bytes, max_payload: int,
                  bulk_timeout: float = BULK_TIMEOUT_S, source: str | None = None,
                  encrypt: bool = False) -> Channel:
    """Open an authenticated channel to a peer sidecar; PeerRefused if it turns us away.
    A bulk payload received on it fails after `bulk_timeout` seconds without a byte.
    `source`: this sidecar's own address, to connect from (holders accept a rank's replica
    only from that rank's address); a wildcard or another family is left to the kernel.
    `encrypt`: payloads encrypted both ways (protocol.py; the peer must agree)."""
    loop = asyncio.get_running_loop()
    family = socket.AF_INET6 if ":" in addr.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setblocking(False)
    try:
        _bind_source(sock, source, addr.host)
        await asyncio.wait_for(loop.sock_connect(sock, (addr.host, addr.port)), CONNECT_TIMEOUT_S)
        chan = Channel(sock, token, max_payload, server=False, bulk_timeout=bulk_timeout,
                       peer=str(addr), encrypt=encrypt)
        await asyncio.wait_for(chan.client_handshake(job), CONNECT_TIMEOUT_S)
    except PeerRefused as err:  # it said why
        sock.close()
        raise PeerRefused(f"{addr} refused the handshake: {err}") from err
    except (ConnectionError, ProtocolError) as err:
        sock.close()
        raise PeerRefused(f"{addr} refused the handshake (wrong job or token?): {err}") from err
    except BaseException:
        sock.close()
        raise
    return chan


def _bind_source(sock: socket.socket, source: str | None, dest: str) -> None:
    """Connect from `source` where it can be: not a wildcard, the destination's family, and
    not loopback towards an address that is not (a sidecar without GEMINI_POD_IP)."""
    if not source or source in ("0.0.0.0", "::") or (":" in source) != (":" in dest):
        return
    if _is_loopback(source) and not _is_loopback(dest):
        return
    with contextlib.suppress(OSError):  # the holder then judges the kernel's choice
        sock.bind((source, 0))


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"


def even_plan(length: int, chunk_bytes: int) -> list[PlannedChunk]:
    """All chunks at once (the "immediate" mode)."""
    step = max(8, chunk_bytes // 8 * 8)
    return [PlannedChunk(o, min(step, length - o), 0.0) for o in range(0, length, step)]


async def _reply(chan: Channel) -> Frame:
    """The next reply; PeerRefused for an ERROR, unless it flags corrupt chunks (returned)."""
    reply = await asyncio.wait_for(chan.recv(), REPLY_TIMEOUT_S)
    if reply.type == FrameType.ERROR:
        message = (await chan.recv_payload(reply)).decode(errors="replace")
        if not reply.flags & FLAG_CORRUPT:
            raise PeerRefused(message)
        log.warning("peer: %s", message)
        return reply
    if reply.type != FrameType.ACK:
        raise ProtocolError(f"expected ACK, got {reply.type.name}")
    await chan.discard(reply.length)
    return reply


async def send_version(
    chan: Channel,
    rank: int,
    version: int,
    data: memoryview,
    source_crc: int,
    plan: Sequence[PlannedChunk],
    still_valid: Callable[[], bool],
    window: int = 8,
) -> int:
    """Send one version to the peer on `chan`; returns the payload bytes sent.

    The sender reads its bytes once, to send them. The peer acknowledges each chunk with
    the CRC-32 of what it received, and completes the version only if those combine into
    `source_crc` (the trainer's CRC-32 of the whole version). If not, the sender takes the
    CRC-32 of its own chunks (this once) and resends the ones that differ.

    Raises PeerRefused (budget, not a holder, persistent corruption), SourceChanged.
    """
    begin = Frame(FrameType.PUT_BEGIN, rank, version, total=len(data), checksum=source_crc)
    await chan.send(begin)
    if (await _reply(chan)).type != FrameType.ACK:
        raise ProtocolError("peer flagged corruption before any chunk")
    received: dict[int, int] = {}  # offset -> the CRC-32 the peer took of that chunk
    todo = list(plan)
    sent = 0
    for _ in range(RESEND_ROUNDS + 1):
        await _send_chunks(chan, rank, version, data, todo, received, window)
        sent += sum(c.length for c in todo)
        if not still_valid():
            raise SourceChanged(f"rank {rank} version {version} was overwritten while being sent")
        await chan.send(Frame(FrameType.PUT_END, rank, version, checksum=source_crc))
        reply = await _reply(chan)
        if reply.type == FrameType.ACK:
            if not reply.flags & FLAG_COMPLETE:
                raise ProtocolError("peer did not confirm the version complete")
            return sent
        todo = await asyncio.to_thread(_corrupt_chunks, data, plan, received)
        if not still_valid():
            raise SourceChanged(f"rank {rank} version {version} was overwritten while being sent")
        if not todo:
            raise PeerRefused(f"rank {rank} version {version}: the local bytes do not match the "
                              "trainer's CRC-32 (corrupt in shared memory); not replicated")
        log.warning("peer received %d corrupt chunks of rank %d v%d; resending", len(todo),
                    rank, version)
    raise PeerRefused(f"chunks of rank {rank} v{version} kept arriving corrupt")


def _corrupt_chunks(data: memoryview, plan: Sequence[PlannedChunk],
                    received: dict[int, int]) -> list[PlannedChunk]:
    """The chunks whose CRC-32 at the peer differs from the local bytes' (resent at once)."""
    return [PlannedChunk(c.offset, c.length, 0.0) for c in plan
            if crc32(data[c.offset : c.offset + c.length]) != received.get(c.offset)]


async def _send_chunks(
    chan: Channel, rank: int, version: int, data: memoryview, plan: Sequence[PlannedChunk],
    received: dict[int, int], window: int,
) -> None:
    """Send `plan` with up to `window` chunks unacknowledged; records the peer's CRCs."""
    loop = asyncio.get_running_loop()
    slots = asyncio.Semaphore(window)
    pending: asyncio.Queue[PlannedChunk | None] = asyncio.Queue()

    async def read_replies() -> None:
        try:
            while (chunk := await pending.get()) is not None:
                reply = await _reply(chan)
                if reply.type != FrameType.ACK or reply.offset != chunk.offset:
                    raise ProtocolError(f"unexpected reply {reply.type.name} at {reply.offset}")
                if reply.flags & FLAG_CORRUPT:  # failed its MAC there: resent after PUT_END
                    received.pop(chunk.offset, None)
                else:
                    received[chunk.offset] = reply.checksum
                slots.release()
        finally:
            for _ in range(window + 1):  # wake a sender blocked on the window if we failed
                slots.release()

    reader = asyncio.create_task(read_replies())
    try:
        start = loop.time()
        for chunk in plan:
            wait = start + chunk.delay_s - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            await slots.acquire()
            if reader.done():
                break
            piece = data[chunk.offset : chunk.offset + chunk.length]
            pending.put_nowait(chunk)
            await chan.send(Frame(FrameType.PUT_CHUNK, rank, version, chunk.offset,
                                  chunk.length), piece)
        pending.put_nowait(None)
        await reader
    finally:
        reader.cancel()
