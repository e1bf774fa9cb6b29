"""An aiohttp application's listening server behind a connection gate (gemini.serving.gate):
a connection over the limits is closed at once and logged; aiohttp's keep-alive timer, set to
the header timeout, closes a connection that has not sent a complete request header within
it (and idle keep-alive connections)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from aiohttp import web

from gemini.serving.gate import ConnectionGate, RefusalLog, address_of, host_of

# Connections the kernel queues before accept(): a deep queue rides out a burst (a flood, or a
# pause while out of descriptors) instead of dropping SYNs, which cost a 1 s retransmit each.
LISTEN_BACKLOG = 1024


class GatedHttpListener:
    """`runner` (set up, not started) served on host:port behind `gate`; refusals logged as
    `name` and counted in `refused` (a prometheus Counter); `on_count(open)` after each
    change in the number of open connections (a gauge)."""

    def __init__(self, runner: web.AppRunner, gate: ConnectionGate, name: str, refused: Any,
                 on_count: Callable[[int], None] = lambda n: None) -> None:
        self._runner = runner
        self.gate = gate
        self._on_count = on_count
        self.refusals = RefusalLog(name, refused)
        self.server: asyncio.Server | None = None

    async def start(self, host: str, port: int) -> int:
        loop = asyncio.get_running_loop()
        self.server = await loop.create_server(self._connection, host, port,
                                               reuse_address=True, backlog=LISTEN_BACKLOG)
        return int(self.server.sockets[0].getsockname()[1])

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
        self.refusals.flush()

    def serving(self) -> bool:
        server = self.server
        return (server is not None and server.is_serving()
                and all(s.fileno() != -1 for s in server.sockets))

    def _connection(self) -> asyncio.Protocol:
        handler = self._runner.server
        assert handler is not None, "runner.setup() first"
        return _GatedConnection(self, handler)

    def admit(self, peer: str) -> bool:
        refusal = self.gate.admit(host_of(peer))
        if refusal is not None:
            self.refusals.refuse(peer, refusal)
            return False
        self._on_count(self.gate.open)
        return True

    def release(self, peer: str) -> None:
        self.gate.release(host_of(peer))
        self._on_count(self.gate.open)


class _GatedConnection(asyncio.Protocol):
    """One connection: admitted by the listener's gate, then aiohttp's own handler."""

    def __init__(self, listener: GatedHttpListener, make_handler: Callable[[], Any]) -> None:
        self._listener = listener
        self._make_handler = make_handler
        self._inner: Any = None  # aiohttp's RequestHandler once admitted
        self._peer = ""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._peer = address_of(transport.get_extra_info("peername"))
        if not self._listener.admit(self._peer):
            transport.abort()  # type: ignore[attr-defined]
            return
        self._inner = self._make_handler()
        self._inner.connection_made(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._inner is not None:
            self._listener.release(self._peer)
            self._inner.connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._inner is not None:
            self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received() if self._inner is not None else None

    def pause_writing(self) -> None:
        if self._inner is not None:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        if self._inner is not None:
            self._inner.resume_writing()
