"""The sidecar's HTTP API listener: aiohttp's request handler (the routes: gemini_sidecar.api)
behind a connection gate (gemini.serving), as the peer server has: the job's own pods are held
to the per-address limit only, everyone else also to the total."""

from __future__ import annotations

from collections.abc import Callable

from aiohttp import web

from gemini.serving.gate import ConnectionGate
from gemini.serving.http import GatedHttpListener
from gemini_sidecar.config import ServerLimits
from gemini_sidecar.metrics import SidecarMetrics
from gemini_sidecar.peer_server import ListenerHealth


class ApiListener(GatedHttpListener):
    def __init__(self, runner: web.AppRunner, limits: ServerLimits, metrics: SidecarMetrics,
                 trusted: Callable[[str], bool] = lambda host: False) -> None:
        super().__init__(runner, ConnectionGate(limits, "GEMINI", trusted=trusted), "API",
                         metrics.api_refused, metrics.api_connections.set)

    def health(self) -> ListenerHealth:
        connections = self.gate.open
        if self.server is None:
            return ListenerHealth("dead", "not started", connections, healthy=False)
        if not self.serving():
            return ListenerHealth("dead", "the listening socket is closed", connections,
                                  healthy=False)
        return ListenerHealth("accepting", connections=connections)
