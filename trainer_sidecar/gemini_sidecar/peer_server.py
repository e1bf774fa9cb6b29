"""Peer server: receives replicas of the ranks this sidecar holds and serves fetches.

One task per connection on the event loop. Every refusal (handshake from another job or
without the token, malformed or oversized frame) is logged and counted, the connection is
closed, and the server keeps serving everyone else.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable
from dataclasses import dataclass

from gemini_sidecar.checksum import crc32
from gemini_sidecar.local import LocalShard, LocalShardError
from gemini_sidecar.metrics import SidecarMetrics
from gemini_sidecar.protocol import (
    FLAG_COMPLETE,
    FLAG_CORRUPT,
    FLAG_EXACT,
    Channel,
    Frame,
    FrameType,
    ProtocolError,
)
from gemini_sidecar.store import (
    BudgetExceeded,
    ReplicaStore,
    StoreError,
    WholeChecksumMismatch,
)

log = logging.getLogger(__name__)
HANDSHAKE_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class ServerContext:
    job: str
    token: bytes
    rank: int
    max_payload: int
    store: ReplicaStore
    local: LocalShard
    metrics: SidecarMetrics
    hold_ranks: Callable[[], tuple[int, ...]]  # current placement (it can change)
    on_change: Callable[[], None]  # the replica store changed (refresh gauges)


class PeerServer:
    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx
        self._listener: socket.socket | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._accept: asyncio.Task[None] | None = None

    async def start(self, host: str, port: int) -> int:
        """Listen on host:port (0 = any free port); returns the bound port."""
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        lsock = socket.socket(family, socket.SOCK_STREAM)
        lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        lsock.bind((host, port))
        lsock.listen(128)
        lsock.setblocking(False)
        self._listener = lsock
        self._accept = asyncio.create_task(self._accept_loop())
        return int(lsock.getsockname()[1])

    async def stop(self) -> None:
        for task in [self._accept, *self._tasks]:
            if task is not None:
                task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._listener is not None:
            self._listener.close()

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._listener is not None
        while True:
            conn, addr = await loop.sock_accept(self._listener)
            task = asyncio.create_task(self._serve(conn, f"{addr[0]}:{addr[1]}"))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _serve(self, conn: socket.socket, peer: str) -> None:
        chan = Channel(conn, self.ctx.token, self.ctx.max_payload, server=True)
        try:
            await asyncio.wait_for(chan.server_handshake(self.ctx.job), HANDSHAKE_TIMEOUT_S)
            while True:
                await self._dispatch(chan, await chan.recv())
        except (ProtocolError, TimeoutError, UnicodeDecodeError) as err:
            self.ctx.metrics.refused_frames.inc()
            log.warning("refused peer %s: %s", peer, err)
        except (ConnectionError, OSError):
            pass  # peer went away; nothing to refuse
        finally:
            chan.close()

    async def _dispatch(self, chan: Channel, frame: Frame) -> None:
        handler = {
            FrameType.PUT_BEGIN: self._put_begin,
            FrameType.PUT_CHUNK: self._put_chunk,
            FrameType.PUT_END: self._put_end,
            FrameType.GET_INFO: self._get_info,
            FrameType.GET: self._get,
        }.get(frame.type)
        if handler is None:
            raise ProtocolError(f"unexpected {frame.type.name} frame from a client")
        if frame.type != FrameType.PUT_CHUNK:
            await chan.discard(frame.length)  # requests carry no payload we use
        await handler(chan, frame)

    # -- replication (receiving) -------------------------------------------------------------
    async def _put_begin(self, chan: Channel, frame: Frame) -> None:
        if frame.rank not in self.ctx.hold_ranks():
            await chan.send_error(f"this sidecar does not hold rank {frame.rank}")
            return
        try:
            self.ctx.store.begin(frame.rank, frame.version, frame.total, frame.checksum)
        except BudgetExceeded as err:
            self.ctx.metrics.budget_refusals.inc()
            log.error("%s", err)
            await chan.send_error(str(err))
            return
        self.ctx.on_change()
        await chan.send(Frame(FrameType.ACK, frame.rank, frame.version))

    async def _put_chunk(self, chan: Channel, frame: Frame) -> None:
        try:
            view = self.ctx.store.chunk_view(frame.rank, frame.version, frame.offset, frame.length)
        except StoreError as err:
            await chan.discard(frame.length)
            await chan.send_error(str(err))
            return
        crc = await chan.recv_crc_into(frame, view)
        self.ctx.store.chunk_done(frame.rank, frame.version, frame.offset, frame.length, crc)
        # the CRC of what landed goes back authenticated: the sender finds bad chunks with it
        ack = Frame(FrameType.ACK, frame.rank, frame.version, frame.offset, 0, crc, frame.length)
        await chan.send(ack)

    async def _put_end(self, chan: Channel, frame: Frame) -> None:
        try:
            self.ctx.store.finish(frame.rank, frame.version, frame.checksum)
        except WholeChecksumMismatch as err:  # kept open: the sender resends the bad chunks
            log.warning("%s; asking the sender to resend the corrupt chunks", err)
            await chan.send_error(f"checksum mismatch: {err}", FLAG_CORRUPT)
            return
        except StoreError as err:
            self.ctx.store.abort(frame.rank, frame.version)
            await chan.send_error(str(err))
            return
        self.ctx.on_change()
        await chan.send(Frame(FrameType.ACK, frame.rank, frame.version, flags=FLAG_COMPLETE))

    # -- fetches (serving) -------------------------------------------------------------------
    def _source(self, rank: int, version: int | None) -> tuple[int, int, memoryview]:
        """(version, source checksum, bytes) of a complete version held here."""
        if rank == self.ctx.rank:
            info, view = self.ctx.local.read(version)
            return info.version, info.checksum, view
        replica, data = self.ctx.store.get(rank, version)
        return replica.version, replica.checksum, data

    async def _get_info(self, chan: Channel, frame: Frame) -> None:
        wanted = frame.version if frame.flags & FLAG_EXACT else None
        try:
            version, source_sum, data = self._source(frame.rank, wanted)
        except (StoreError, LocalShardError) as err:
            await chan.send_error(str(err))
            return
        await chan.send(
            Frame(FrameType.INFO, frame.rank, version, 0, 0, source_sum, len(data), FLAG_COMPLETE)
        )

    async def _get(self, chan: Channel, frame: Frame) -> None:
        try:
            _, _, data = self._source(frame.rank, frame.version)
        except (StoreError, LocalShardError) as err:
            await chan.send_error(str(err))
            return
        end = frame.offset + frame.total
        if frame.offset < 0 or end > len(data) or frame.total > self.ctx.max_payload:
            await chan.send_error(f"range [{frame.offset}, {end}) outside {len(data)} bytes")
            return
        piece = data[frame.offset : end]
        reply = Frame(
            FrameType.DATA, frame.rank, frame.version, frame.offset, len(piece), crc32(piece)
        )
        await chan.send(reply, piece)
