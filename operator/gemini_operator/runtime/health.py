"""The operator's health, served beside its metrics (`--metrics-port`): the probes' endpoints.

GET /healthz (liveness): 200 while the process's event loop turns (a beat at least every
`LOOP_STALL_SECONDS`) and none of its long-running loops (leader election, resync, poll, the
work queue's workers) has ended; 503 before the loop has started, and when either fails, so
the kubelet restarts a stuck operator instead of keeping a process that serves metrics and
nothing else. GET /readyz (readiness): the same, and the start-up handler has finished (the
loops and the hint server are started). A replica that does not lead is live and ready: it is
a stand-by. Every other path is the Prometheus exposition, as before.

Both are served on an event loop of its own (a daemon thread) behind a connection gate
(gemini.serving: per address and in total; a request header within HEADER_TIMEOUT_SECONDS).
With `--health-port` the two probe paths also get a listener of their own that a flood of
connections cannot starve (gemini.serving.probes): the chart's probes use it.
"""

from __future__ import annotations

import asyncio
import gzip
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

from gemini.serving.fds import log_accept_errors_once
from gemini.serving.gate import UNCOUNTED, ConnectionGate, ConnectionLimits
from gemini.serving.http import GatedHttpListener
from gemini.serving.probes import Check as ProbeCheck
from gemini.serving.probes import ProbeListener

HEALTHZ_PATH = "/healthz"
READYZ_PATH = "/readyz"
BEAT_SECONDS = 1.0
# The event loop may be busy for a while (a large list answered at start-up), never this long.
LOOP_STALL_SECONDS = 60.0
HEADER_TIMEOUT_SECONDS = 5.0  # a connection must send its request header by then


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


# Connections to the metrics port: Prometheus holds one or two per replica.
METRICS_LIMITS = ConnectionLimits(256, 16)


def make_app(registry: CollectorRegistry, health: Health) -> web.Application:
    """/healthz and /readyz from `health`; any other path: the metrics of `registry` (in the
    format the scraper asks for, gzipped when it accepts that)."""
    async def metrics(request: web.Request) -> web.Response:
        encoder, content_type = choose_encoder(request.headers.get("Accept", ""))
        body = await asyncio.to_thread(encoder, registry)
        headers = {"Content-Type": content_type}
        if "gzip" in request.headers.get("Accept-Encoding", ""):
            body, headers["Content-Encoding"] = gzip.compress(body), "gzip"
        return web.Response(body=body, headers=headers)

    def probe(check: ProbeCheck) -> Callable[[web.Request], Awaitable[web.Response]]:
        async def answer(request: web.Request) -> web.Response:
            ok, body = check()
            return web.json_response(dict(body), status=200 if ok else 503)
        return answer

    app = web.Application(client_max_size=4096)
    for path, check in probe_checks(health).items():
        app.router.add_get(path, probe(check))
    app.router.add_get("/{tail:.*}", metrics)
    return app


def probe_checks(health: Health) -> dict[str, ProbeCheck]:
    """The probe listener's paths (gemini.serving.probes)."""
    def check(of: Callable[[], Check]) -> ProbeCheck:
        def run() -> tuple[bool, dict[str, str]]:
            result = of()
            return result.ok, result.to_json()
        return run

    return {HEALTHZ_PATH: check(health.live), READYZ_PATH: check(health.ready)}


class MetricsServer:
    """The metrics port (and the probes' own port, when given) served on an event loop of
    their own in a daemon thread, so a busy operator loop neither delays a scrape nor hides
    itself from /healthz (the loop's beat says that)."""

    def __init__(self, registry: CollectorRegistry, health: Health, refused: Any = None,
                 limits: ConnectionLimits = METRICS_LIMITS) -> None:
        self._registry, self._health = registry, health
        self._refused = refused or (lambda listener: UNCOUNTED)
        self._limits = limits
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="metrics-server",
                                        daemon=True)
        self._stops: list[Callable[[], Awaitable[None]]] = []
        self.port = 0
        self.probe_port: int | None = None

    def start(self, addr: str, port: int | None, probe_port: int | None = None
              ) -> MetricsServer:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(addr, port, probe_port),
                                         self._loop).result(30)
        return self

    async def _start(self, addr: str, port: int | None, probe_port: int | None) -> None:
        log_accept_errors_once(asyncio.get_running_loop(), "metrics server")
        if port is not None:
            await self._start_metrics(addr, port)
        if probe_port is not None:
            probes = ProbeListener(probe_checks(self._health), "probe server",
                                   self._refused("probes"))
            self.probe_port = await probes.start(addr, probe_port)
            self._stops.append(probes.stop)

    async def _start_metrics(self, addr: str, port: int) -> None:
        runner = web.AppRunner(make_app(self._registry, self._health), access_log=None,
                               keepalive_timeout=HEADER_TIMEOUT_SECONDS, lingering_time=0)
        await runner.setup()
        listener = GatedHttpListener(
            runner, ConnectionGate(self._limits),
            "metrics server", self._refused("metrics"))
        self.port = await listener.start(addr, port)
        self._stops += [listener.stop, runner.cleanup]

    def stop(self) -> None:
        async def stop_all() -> None:
            for stop in self._stops:
                await stop()

        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(stop_all(), self._loop).result(10)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)


def start_metrics_server(port: int | None, registry: CollectorRegistry, health: Health,
                         addr: str = "0.0.0.0", probe_port: int | None = None,
                         refused: Any = None) -> MetricsServer:
    """Serve `make_app` on `port` and the probes alone on `probe_port` (None: not that one);
    `refused(listener)`: the counter of refused connections of a listener."""
    return MetricsServer(registry, health, refused).start(addr, port, probe_port)
