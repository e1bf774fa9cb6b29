"""The sidecar's HTTP API listener: aiohttp's request handler (the routes: gemini_sidecar.api)
behind a connection gate, as the peer server has (gemini_sidecar.peer_server)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from aiohttp import web

from gemini_sidecar.config import ServerLimits
from gemini_sidecar.metrics import SidecarMetrics
from gemini_sidecar.peer_server import (
    LISTEN_BACKLOG,
    ConnectionGate,
    ListenerHealth,
    RefusalLog,
    address_of,
    host_of,
)


class ApiListener:
    """The HTTP API's listening server: aiohttp's request handler behind a connection gate
    (total and per-host limits; a refusal is closed at once and logged). aiohttp's keep-alive
    timer, set to the header timeout, closes a connection that has not sent a complete
    request header within it (and idle keep-alive connections)."""

    def __init__(self, runner: web.AppRunner, limits: ServerLimits,
                 metrics: SidecarMetrics) -> None:
        self._runner = runner
        self._gate = ConnectionGate(limits)
        self._metrics = metrics
        self.refusals = RefusalLog("API", metrics.api_refused)
        self._server: asyncio.Server | None = None

    async def start(self, host: str, port: int) -> int:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(self._connection, host, port,
                                                reuse_address=True, backlog=LISTEN_BACKLOG)
        return int(self._server.sockets[0].getsockname()[1])

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        self.refusals.flush()

    def health(self) -> ListenerHealth:
        server, connections = self._server, self._gate.open
        if server is None:
            return ListenerHealth("dead", "not started", connections, healthy=False)
        if not server.is_serving() or any(s.fileno() == -1 for s in server.sockets):
            return ListenerHealth("dead", "the listening socket is closed", connections,
                                  healthy=False)
        return ListenerHealth("accepting", connections=connections)

    def _connection(self) -> asyncio.Protocol:
        handler = self._runner.server
        assert handler is not None, "runner.setup() first"
        return _GatedConnection(self, handler)

    def admit(self, peer: str) -> bool:
        refusal = self._gate.admit(host_of(peer))
        if refusal is not None:
            self.refusals.refuse(peer, refusal)
            return False
        self._metrics.api_connections.set(self._gate.open)
        return True

    def release(self, peer: str) -> None:
        self._gate.release(host_of(peer))
        self._metrics.api_connections.set(self._gate.open)


class _GatedConnection(asyncio.Protocol):
    """One API connection: admitted by the listener's gate, then aiohttp's own handler."""

    def __init__(self, listener: ApiListener, make_handler: Callable[[], Any]) -> None:
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
