"""Fetch one (rank, version) from the sidecars that hold it, into memory given by the caller.

Holders are tried in the order the operator gave. Chunks are requested pipelined from one
holder; a chunk that arrives corrupt, or a holder that fails mid-way, sends the remaining
chunks to the next holder. The whole payload is then checked against the CRC-32 the trainer
wrote in its slot header; a mismatch (corruption at rest) fetches everything again from the
next holder. Nothing is reported complete unless that final check passes.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from gemini_sidecar.checksum import crc32_of_pieces
from gemini_sidecar.config import PeerAddress
from gemini_sidecar.metrics import SidecarMetrics
from gemini_sidecar.peer_bulk import PEER_SILENCE_S
from gemini_sidecar.peer_client import FetchFailed, connect
from gemini_sidecar.peer_frames import (
    FLAG_EXACT,
    ChecksumMismatch,
    Frame,
    FrameType,
    PeerRefused,
    ProtocolError,
)
from gemini_sidecar.protocol import Channel
from gemini_sidecar.transfers import Progress

log = logging.getLogger(__name__)
# A holder is given up when it sends nothing for this long, however large the shard: the
# replies stream back to back, so silence means the holder stopped (SIGSTOP, a hung process,
# a cut-off node), not a large transfer. A slow link keeps bytes coming and is waited for.
REPLY_SILENCE_S = PEER_SILENCE_S

Allocate = Callable[[int, int, int], memoryview]  # (version, length, crc) -> writable memory


@dataclass(frozen=True)
class Fetched:
    rank: int
    version: int
    length: int
    checksum: int  # CRC-32 from the source's slot header, verified over the whole payload
    holders_used: tuple[str, ...]


@dataclass(frozen=True)
class FetchRequest:
    job: str
    token: bytes
    max_payload: int
    rank: int
    version: int | None  # None: the newest complete version of the first holder that answers
    holders: Sequence[PeerAddress]
    chunk_bytes: int = 16 << 20
    window: int = 8
    encrypt: bool = False  # GEMINI_PEER_ENCRYPTION


async def _info(chan: Channel, rank: int, version: int | None) -> tuple[int, int, int]:
    flags = FLAG_EXACT if version is not None else 0
    await chan.send(Frame(FrameType.GET_INFO, rank, version or 0, flags=flags))
    reply = await asyncio.wait_for(chan.recv(), REPLY_SILENCE_S)
    if reply.type == FrameType.ERROR:
        raise PeerRefused((await chan.recv_payload(reply)).decode(errors="replace"))
    if reply.type != FrameType.INFO:
        raise ProtocolError(f"expected INFO, got {reply.type.name}")
    return reply.version, reply.total, reply.checksum


async def _pull(
    chan: Channel, rank: int, version: int, dest: memoryview, chunks: list[tuple[int, int]],
    window: int, done: dict[int, int], progress: Progress,
) -> None:
    """Request `chunks` pipelined; those that arrive intact go into `done` as offset -> their
    CRC-32 (also when the holder fails half-way, so the next holder only fetches the rest)."""
    queue = list(chunks)
    in_flight: list[tuple[int, int]] = []
    while queue or in_flight:
        while queue and len(in_flight) < window:
            off, size = queue.pop(0)
            await chan.send(Frame(FrameType.GET, rank, version, off, 0, 0, size))
            in_flight.append((off, size))
        off, size = in_flight.pop(0)
        reply = await asyncio.wait_for(chan.recv(), REPLY_SILENCE_S)
        if reply.type == FrameType.ERROR:
            raise PeerRefused((await chan.recv_payload(reply)).decode(errors="replace"))
        if reply.type != FrameType.DATA or (reply.offset, reply.length) != (off, size):
            raise ProtocolError(f"expected DATA at {off}, got {reply.type.name}")
        try:
            done[off] = await chan.recv_into(reply, dest[off : off + size])
            progress.add(size)
        except ChecksumMismatch as err:
            log.warning("%s (from %s); will refetch it from another holder", err, chan.peer)


async def fetch(req: FetchRequest, allocate: Allocate, metrics: SidecarMetrics,
                progress: Progress | None = None) -> Fetched:
    """Fetch `req.rank` into memory from `allocate`; raises FetchFailed if no holder can.
    `progress` counts its length once known and each chunk as it lands."""
    holders = list(req.holders)
    progress = progress if progress is not None else Progress()
    expected: list[int] = []

    def counted(version: int, length: int, crc: int) -> memoryview:
        if not expected:
            expected.append(length)
            progress.expect(length)
        return allocate(version, length, crc)

    for start in range(len(holders)):  # whole-payload attempts, each from a rotated order
        order = holders[start:] + holders[:start]
        try:
            return await _fetch_once(req, order, counted, metrics, progress)
        except _CorruptWhole as err:
            metrics.fetch_failures.inc()
            log.warning("%s; fetching it again starting from the next holder", err)
    raise FetchFailed(f"no holder of rank {req.rank} among {[str(h) for h in holders]} "
                      "delivered an intact copy")


class _CorruptWhole(Exception):
    pass


async def _fetch_once(
    req: FetchRequest, order: list[PeerAddress], allocate: Allocate, metrics: SidecarMetrics,
    progress: Progress,
) -> Fetched:
    dest: memoryview | None = None
    version, length, crc = req.version, 0, 0
    remaining: list[tuple[int, int]] = []
    done: dict[int, int] = {}
    chunks: list[tuple[int, int]] = []
    used: list[str] = []
    for holder in order:
        try:
            chan = await connect(holder, req.job, req.token, req.max_payload, REPLY_SILENCE_S,
                                 encrypt=req.encrypt)
        except (PeerRefused, OSError, TimeoutError) as err:
            metrics.fetch_failures.inc()
            log.warning("holder %s unreachable: %s", holder, err)
            continue
        try:
            got_version, got_length, got_crc = await _info(chan, req.rank, version)
            if dest is None:
                version, length, crc = got_version, got_length, got_crc
                dest = allocate(got_version, got_length, got_crc)
                step = max(8, req.chunk_bytes // 8 * 8)
                chunks = [(o, min(step, length - o)) for o in range(0, length, step)]
                remaining = list(chunks)
            elif (got_version, got_length, got_crc) != (version, length, crc):
                raise PeerRefused(f"{holder} holds another copy of version {version}")
            used.append(str(holder))
            await _pull(chan, req.rank, got_version, dest, remaining, req.window, done,
                        progress)
        except (PeerRefused, ProtocolError, OSError, TimeoutError) as err:
            metrics.fetch_failures.inc()
            log.warning("fetch of rank %d from %s failed: %s", req.rank, holder, err)
            continue
        finally:
            chan.close()
            remaining = [c for c in remaining if c[0] not in done]
        if remaining:
            metrics.fetch_failures.inc()
            continue
        # the chunk CRCs, each taken as its bytes landed, combine into the whole payload's
        actual = crc32_of_pieces([(done[off], size) for off, size in chunks])
        if actual != crc:
            raise _CorruptWhole(f"rank {req.rank} v{version} from {used}: CRC-32 {actual:#x} "
                                f"!= {crc:#x}")
        assert version is not None
        return Fetched(req.rank, version, length, crc, tuple(used))
    raise FetchFailed(f"could not fetch rank {req.rank} version {version} from any of "
                      f"{[str(h) for h in order]}")
