"""Peer server: receives replicas of the ranks this sidecar holds and serves fetches.

One task per connection on the event loop. Every refusal (over the connection limits, no
handshake in time, a handshake from another job or without the token, a malformed, oversized
or unfinished frame) is logged once with the peer's address and the reason and counted, the
connection is closed, and the server keeps serving everyone else. The accept loop survives
errors: out of file descriptors (EMFILE) it logs once, backs off briefly and keeps accepting;
only a listening socket that is gone ends it, and `health()` then says so (/healthz: 503).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from gemini.serving.gate import ConnectionGate, RefusalLog, address_of, host_of
from gemini.serving.http import LISTEN_BACKLOG
from gemini_sidecar.checksum import crc32
from gemini_sidecar.config import PeerAddress, ServerLimits
from gemini_sidecar.local import LocalShard, LocalShardError
from gemini_sidecar.metrics import SidecarMetrics
from gemini_sidecar.peer_bulk import BULK_TIMEOUT_S, ChannelPools
from gemini_sidecar.peer_frames import (
    FLAG_COMPLETE,
    FLAG_CORRUPT,
    FLAG_EXACT,
    Frame,
    FrameType,
    PayloadTampered,
    ProtocolError,
)
from gemini_sidecar.protocol import Channel
from gemini_sidecar.senders import KnownPeers, SenderCheck
from gemini_sidecar.store import (
    BudgetExceeded,
    ReplicaStore,
    StoreError,
    WholeChecksumMismatch,
)

log = logging.getLogger(__name__)
# the listening socket itself is gone or no longer listening: nothing to retry
LISTENER_GONE = frozenset({errno.EBADF, errno.EINVAL, errno.ENOTSOCK})
# errors of the one pending connection that accept() passes on (accept(2)): take the next one.
# Any other error (out of descriptors or memory: EMFILE, ENFILE, ENOBUFS, ENOMEM) leaves the
# connection queued: back off and retry.
CONNECTION_ERRORS = frozenset({
    errno.ECONNABORTED, errno.EPROTO, errno.ENOPROTOOPT, errno.EHOSTDOWN, errno.ENONET,
    errno.EHOSTUNREACH, errno.EOPNOTSUPP, errno.ENETUNREACH, errno.ENETDOWN, errno.EPERM,
})
BACKOFF_FIRST_S = 0.05
BACKOFF_MAX_S = 1.0
# accepting has failed for this long without a break: as good as dead (/healthz: 503)
FAILING_UNHEALTHY_S = 60.0


def _listener_gone(err: Exception) -> bool:
    return isinstance(err, ValueError) or (isinstance(err, OSError)
                                           and err.errno in LISTENER_GONE)


@dataclass(frozen=True)
class ListenerHealth:
    """What /healthz reports about one listener."""

    state: str  # accepting, backing off (accept fails, retrying), dead, stopped
    detail: str = ""
    connections: int = 0
    healthy: bool = True

    def to_json(self) -> dict[str, object]:
        doc: dict[str, object] = {"state": self.state, "healthy": self.healthy,
                                  "connections": self.connections}
        if self.detail:
            doc["detail"] = self.detail
        return doc


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
    peer_of: Callable[[int], PeerAddress | None]  # a rank's address in the current placement
    on_change: Callable[[], None]  # the replica store changed (refresh gauges)
    # the placement's peers (rank -> address): their addresses are not held to the total
    # limit, so addresses outside the job that fill it cannot keep the job's peers out
    peers: Callable[[], Mapping[int, PeerAddress]] = dict
    limits: ServerLimits = field(default_factory=ServerLimits)
    check_senders: bool = True  # a rank's replica only from that rank's address (senders.py)
    encrypt: bool = False  # GEMINI_PEER_ENCRYPTION: refuse peers that do not encrypt


class PeerServer:
    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx
        self._listener: socket.socket | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._accept: asyncio.Task[None] | None = None
        self._senders = SenderCheck(ctx.peer_of)
        self.known = KnownPeers(ctx.peers, self._senders)
        self._gate = ConnectionGate(ctx.limits, "GEMINI", trusted=self.known.has)
        self._refusals = RefusalLog("peer server", ctx.metrics.refused_frames)
        # a connection holds at most one thread of each pool: none can starve another
        self._pools = ChannelPools.sized(ctx.limits.max_connections, "peer")
        self._failing_since: float | None = None  # accept has failed since then
        self._accept_failures = 0
        self._last_accept_error = ""
        self._dead = ""  # why the accept loop ended (the listener is gone)
        self._stopped = False

    async def start(self, host: str, port: int) -> int:
        """Listen on host:port (0 = any free port); returns the bound port."""
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        lsock = socket.socket(family, socket.SOCK_STREAM)
        lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        lsock.bind((host, port))
        lsock.listen(LISTEN_BACKLOG)
        lsock.setblocking(False)
        self._listener = lsock
        self._accept = asyncio.create_task(self._accept_loop())
        self.known.start()
        return int(lsock.getsockname()[1])

    async def stop(self) -> None:
        self._stopped = True
        self.known.stop()
        for task in [self._accept, *self._tasks]:
            if task is not None:
                task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._listener is not None:
            self._listener.close()
        self._pools.shutdown()
        self._refusals.flush()

    # -- accepting ---------------------------------------------------------------------------
    def health(self) -> ListenerHealth:
        """The accept loop's real state: accepting, backing off after errors, or dead."""
        connections = self._gate.open
        if self._stopped:
            return ListenerHealth("stopped", connections=connections, healthy=False)
        dead = self._dead or self._why_dead()
        if dead:
            return ListenerHealth("dead", dead, connections, healthy=False)
        if self._failing_since is not None:
            failing_s = time.monotonic() - self._failing_since
            detail = (f"accept has failed {self._accept_failures} times for {failing_s:.0f} s:"
                      f" {self._last_accept_error}")
            return ListenerHealth("backing off", detail, connections,
                                  healthy=failing_s < FAILING_UNHEALTHY_S)
        return ListenerHealth("accepting", connections=connections)

    def _why_dead(self) -> str:
        if self._listener is None or self._accept is None:
            return "not started"
        if self._listener.fileno() == -1:
            return "the listening socket is closed"
        if self._accept.done():
            return "the accept loop ended"
        return ""

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._listener is not None
        delay = BACKOFF_FIRST_S
        while True:
            try:
                conn, addr = await loop.sock_accept(self._listener)
            except (OSError, ValueError) as err:  # ValueError: the listener was closed
                if _listener_gone(err):
                    self._dead = f"the listening socket failed: {err}"
                    log.error("peer server: no longer accepting connections: %s", err)
                    return
                if getattr(err, "errno", None) in CONNECTION_ERRORS:
                    log.debug("peer server: a connection failed before accept: %s", err)
                    continue
                self._accept_failed(err, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, BACKOFF_MAX_S)
                continue
            delay = BACKOFF_FIRST_S
            self._accept_recovered()
            self._admit(conn, address_of(addr))

    def _accept_failed(self, err: Exception, delay: float) -> None:
        """Count and remember a failed accept; log only the first of a run of them."""
        self.ctx.metrics.accept_errors.inc()
        self._accept_failures += 1
        self._last_accept_error = str(err)
        if self._failing_since is None:
            self._failing_since = time.monotonic()
            log.error("peer server: cannot accept connections (%s); retrying every %g-%g s, "
                      "logged again once it accepts", err, delay, BACKOFF_MAX_S)

    def _accept_recovered(self) -> None:
        if self._failing_since is not None:
            log.warning("peer server: accepting again after %d failed accepts in %.1f s",
                        self._accept_failures, time.monotonic() - self._failing_since)
            self._failing_since = None
            self._accept_failures = 0

    def _admit(self, conn: socket.socket, peer: str) -> None:
        refusal = self._gate.admit(host_of(peer))
        if refusal is not None:
            conn.close()
            self._refusals.refuse(peer, refusal)
            return
        self.ctx.metrics.peer_connections.set(self._gate.open)
        task = asyncio.create_task(self._serve(conn, peer))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _release(self, peer: str) -> None:
        self._gate.release(host_of(peer))
        self.ctx.metrics.peer_connections.set(self._gate.open)

    async def _serve(self, conn: socket.socket, peer: str) -> None:
        try:
            chan = Channel(conn, self.ctx.token, self.ctx.max_payload, server=True,
                           pools=self._pools, read_timeout=self.ctx.limits.read_timeout_s,
                           peer=peer, encrypt=self.ctx.encrypt)
        except OSError as err:  # no file descriptor left for its duplicate
            conn.close()
            self._release(peer)
            self._refusals.refuse(peer, f"cannot set the connection up: {err}")
            return
        try:
            await self._handshake(chan)
            while True:
                await self._dispatch(chan, await chan.recv())
        except (ProtocolError, UnicodeDecodeError) as err:
            self._refusals.refuse(peer, str(err))
        except TimeoutError:  # a bulk payload that stopped coming (the socket's timeout)
            self._refusals.refuse(peer, f"no payload byte for {BULK_TIMEOUT_S:g} s")
        except (ConnectionError, OSError):
            pass  # peer went away; nothing to refuse
        finally:
            chan.close()
            self._release(peer)

    async def _handshake(self, chan: Channel) -> None:
        timeout = self.ctx.limits.header_timeout_s
        try:
            await asyncio.wait_for(chan.server_handshake(self.ctx.job), timeout)
        except TimeoutError as err:
            raise ProtocolError(
                f"no handshake within {timeout:g} s (GEMINI_HEADER_TIMEOUT_S)") from err

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
        if self.ctx.check_senders:
            problem = await self._senders.problem(frame.rank, host_of(chan.peer))
            if problem is not None:
                self._refusals.refuse(chan.peer, problem)
                await chan.send_error(problem)
                return
        try:
            self.ctx.store.begin(frame.rank, frame.version, frame.total, frame.checksum)
        except BudgetExceeded as err:
            self.ctx.metrics.budget_refusals.inc()
            log.error("%s", err)
            await chan.send_error(str(err))
            return
        chan.began[frame.rank] = frame.version  # the rank's earlier transfer here is over
        self.ctx.on_change()
        await chan.send(Frame(FrameType.ACK, frame.rank, frame.version))

    async def _not_begun_here(self, chan: Channel, frame: Frame) -> bool:
        """A chunk or end of a transfer this connection did not begin is refused: every pod
        of the job holds the token, but only the connection that passed the sender check at
        PUT_BEGIN may write the transfer (another pod must not overwrite chunks in flight or
        complete a version its owner abandoned)."""
        if chan.began.get(frame.rank) == frame.version:
            return False
        if frame.type == FrameType.PUT_CHUNK:
            await chan.discard(frame.length)
        problem = (f"rank {frame.rank} version {frame.version} was not begun on this "
                   "connection: its chunks come only on the connection that began it")
        self._refusals.refuse(chan.peer, problem)
        await chan.send_error(problem)
        return True

    async def _put_chunk(self, chan: Channel, frame: Frame) -> None:
        if await self._not_begun_here(chan, frame):
            return
        try:
            view = self.ctx.store.chunk_view(frame.rank, frame.version, frame.offset, frame.length)
        except StoreError as err:
            await chan.discard(frame.length)
            await chan.send_error(str(err))
            return
        try:
            crc = await chan.recv_crc_into(frame, view)
        except PayloadTampered as err:  # the sender resends it after PUT_END
            self._refusals.refuse(chan.peer, str(err))
            self.ctx.store.chunk_rejected(frame.rank, frame.version, frame.offset)
            await chan.send(Frame(FrameType.ACK, frame.rank, frame.version, frame.offset, 0, 0,
                                  frame.length, FLAG_CORRUPT))
            return
        self.ctx.store.chunk_done(frame.rank, frame.version, frame.offset, frame.length, crc)
        # the CRC of what landed goes back authenticated: the sender finds bad chunks with it
        ack = Frame(FrameType.ACK, frame.rank, frame.version, frame.offset, 0, crc, frame.length)
        await chan.send(ack)

    async def _put_end(self, chan: Channel, frame: Frame) -> None:
        if await self._not_begun_here(chan, frame):
            return
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
