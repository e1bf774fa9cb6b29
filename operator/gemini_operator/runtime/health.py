"""The operator's health, served beside its metrics (`--metrics-port`): the probes' endpoints.

GET /healthz (liveness): 200 while the process's event loop turns (a beat at least every
`LOOP_STALL_SECONDS`) and none of its long-running loops (leader election, resync, poll, the
work queue's workers) has ended; 503 before the loop has started, and when either fails, so
the kubelet restarts a stuck operator instead of keeping a process that serves metrics and
nothing else. GET /readyz (readiness): the same, and the start-up handler has finished (the
loops and the hint server are started). A replica that does not lead is live and ready: it is
a stand-by. Every other path is the Prometheus exposition, as before.

The server is prometheus_client's (a thread per request in a daemon thread); only the routing
of these two paths is added.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server
from wsgiref.types import StartResponse, WSGIApplication, WSGIEnvironment

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

HEALTHZ_PATH = "/healthz"
READYZ_PATH = "/readyz"
BEAT_SECONDS = 1.0
# The event loop may be busy for a while (a large list answered at start-up), never this long.
LOOP_STALL_SECONDS = 60.0


@dataclass(frozen=True)
class Check:
    ok: bool
    reason: str

    def to_json(self) -> dict[str, str]:
        return {"status": "ok" if self.ok else "failing", "reason": self.reason}


class Health:
    """What the operator process knows of its own health; read from the server's threads."""

    def __init__(self, monotonic: Callable[[], float] = time.monotonic,
                 stall_seconds: float = LOOP_STALL_SECONDS) -> None:
        self._monotonic, self._stall = monotonic, stall_seconds
        self._lock = threading.Lock()
        self._beat: float | None = None
        self._loops: dict[str, asyncio.Future[Any]] = {}
        self._started = False

    def beat(self) -> None:
        with self._lock:
            self._beat = self._monotonic()

    async def heartbeat(self) -> None:
        """Beat while the event loop runs (a task on it)."""
        while True:
            self.beat()
            await asyncio.sleep(BEAT_SECONDS)

    def watch(self, name: str, loop: asyncio.Future[Any]) -> None:
        """A loop that runs as long as the operator does: its end fails liveness."""
        with self._lock:
            self._loops[name] = loop

    def started(self) -> None:
        """The start-up handler has finished."""
        with self._lock:
            self._started = True

    def live(self) -> Check:
        with self._lock:
            beat, loops = self._beat, dict(self._loops)
        if beat is None:
            return Check(False, "starting: the event loop has not run the start-up handler yet")
        stalled = self._monotonic() - beat
        if stalled > self._stall:
            return Check(False, f"the event loop has not turned for {stalled:.0f} s")
        ended = sorted(name for name, loop in loops.items() if loop.done())
        if ended:
            return Check(False, f"loops ended: {', '.join(ended)}")
        return Check(True, "the event loop turns and every loop runs")

    def ready(self) -> Check:
        live = self.live()
        if not live.ok:
            return live
        with self._lock:
            started = self._started
        if not started:
            return Check(False, "starting: the start-up handler has not finished")
        return Check(True, "started")


def make_app(registry: CollectorRegistry, health: Health) -> WSGIApplication:
    """/healthz and /readyz from `health`; any other path: the metrics of `registry`."""
    metrics: WSGIApplication = make_wsgi_app(registry)
    checks = {HEALTHZ_PATH: health.live, READYZ_PATH: health.ready}

    def app(environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        check = checks.get(environ.get("PATH_INFO", ""))
        if check is None:
            return metrics(environ, start_response)
        result = check()
        body = json.dumps(result.to_json()).encode()
        start_response("200 OK" if result.ok else "503 Service Unavailable",
                       [("Content-Type", "application/json"),
                        ("Content-Length", str(len(body)))])
        return [body]

    return app


class _QuietHandler(WSGIRequestHandler):
    """No log line per request (probes come every few seconds)."""

    def log_message(self, format: str, *args: Any) -> None:
        pass


def start_metrics_server(port: int, registry: CollectorRegistry, health: Health,
                         addr: str = "0.0.0.0") -> tuple[WSGIServer, threading.Thread]:
    """Serve `make_app` on `port` as prometheus_client's start_http_server serves the metrics:
    a thread per request, in a daemon thread."""
    server = make_server(addr, port, make_app(registry, health), ThreadingWSGIServer,
                         handler_class=_QuietHandler)
    thread = threading.Thread(target=server.serve_forever, name="metrics-server", daemon=True)
    thread.start()
    return server, thread
