"""How bulk peer payloads move (see gemini_sidecar.protocol): the size from which a payload
goes to a worker thread, the pools of those threads (``ChannelPools``), the helper thread that
tags and checks each piece in order (``InOrder``), and the kernel's watch for a peer that
stops answering (``watch_for_silence``).
"""

from __future__ import annotations

import queue
import socket
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

BULK_BYTES = 64 * 1024  # payloads at least this large move on a worker thread
BULK_TIMEOUT_S = 120.0
# A peer that stops answering (its node cut off or gone) is noticed by the kernel within
# seconds, whatever the size of the transfer: bytes sent and not acknowledged for
# PEER_SILENCE_S end the connection (TCP_USER_TIMEOUT), and so do keepalive probes left
# unanswered on a connection that waits for a reply (about KEEPALIVE_IDLE_S + 3 x 2 s).
PEER_SILENCE_S = 10.0
KEEPALIVE_IDLE_S = 5
CRC_PIECE_BYTES = 1 << 20  # payloads are checked in pieces of about L2 size
CLIENT_POOL_THREADS = 64


@dataclass(frozen=True)
class ChannelPools:
    """Worker threads for bulk payloads, one pool per purpose.

    Bulk transfers block their thread until the peer keeps up; pools of their own keep them
    from starving (or deadlocking, with several sidecars in one process) the default
    executor. A channel holds at most one thread of each pool at a time, so pools as large
    as the connections they serve cannot be exhausted by stalled peers: a stalled one only
    holds its own.
    """

    send: ThreadPoolExecutor  # payloads going out (sent chunks, served fetches)
    receive: ThreadPoolExecutor  # payloads coming in (replicated chunks, fetched data)

    @classmethod
    def sized(cls, threads: int, name: str) -> ChannelPools:
        def pool(purpose: str) -> ThreadPoolExecutor:
            return ThreadPoolExecutor(threads, thread_name_prefix=f"gemini-{name}-{purpose}")

        return cls(pool("send"), pool("recv"))

    def shutdown(self) -> None:
        for pool in (self.send, self.receive):
            pool.shutdown(wait=False, cancel_futures=True)


# Outgoing connections (sends to holders, fetches): as many as this sidecar starts itself.
CLIENT_POOLS = ChannelPools.sized(CLIENT_POOL_THREADS, "client")


def watch_for_silence(sock: socket.socket) -> None:
    """Have the kernel end the connection when the peer stops answering (see PEER_SILENCE_S)."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, int(PEER_SILENCE_S * 1000))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, KEEPALIVE_IDLE_S)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 2)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 3)


class InOrder:
    """Runs `work` on each piece put, in order, on a thread of its own, beside the thread
    that moves the pieces through the socket; `close` waits for the last and raises what
    `work` raised."""

    def __init__(self, work: Callable[[memoryview], None]) -> None:
        self._work = work
        self._pieces: queue.SimpleQueue[memoryview | None] = queue.SimpleQueue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="gemini-peer-tag", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (piece := self._pieces.get()) is not None:
            if self._error is None:
                try:
                    self._work(piece)
                except BaseException as err:  # raised again in close()
                    self._error = err

    def put(self, piece: memoryview) -> None:
        self._pieces.put(piece)

    def close(self) -> None:
        self._pieces.put(None)
        self._thread.join()
        if self._error is not None:
            raise self._error
