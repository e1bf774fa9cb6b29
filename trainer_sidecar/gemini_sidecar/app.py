"""The sidecar process: one rank's peer server, replicator, replica store, pulls, S3
checkpoints and control API, started and stopped together."""

from __future__ import annotations

import asyncio
import json
import logging
import signal

from aiohttp import web

from gemini.control import paths
from gemini.serving.fds import log_accept_errors_once, raise_fd_limit
from gemini.serving.probes import ProbeListener
from gemini_sidecar.api import health_of, make_app
from gemini_sidecar.api_listener import ApiListener
from gemini_sidecar.config import Placement, SidecarConfig
from gemini_sidecar.local import LocalShard
from gemini_sidecar.metrics import SidecarMetrics, make_metrics
from gemini_sidecar.pacing import Profile, load_profile, profile_path
from gemini_sidecar.peer_server import ListenerHealth, PeerServer, ServerContext
from gemini_sidecar.pulls import Pulls
from gemini_sidecar.replicator import Replicator
from gemini_sidecar.s3_checkpoints import S3Checkpoints
from gemini_sidecar.store import ReplicaStore
from gemini_sidecar.transfers import Transfers

log = logging.getLogger(__name__)


class Sidecar:
    """One rank's checkpoint sidecar: its parts, and the state the operator sets (placement,
    traffic profile) and the trainer reports (its newest version). `start()` binds both
    servers; `stop()` releases them. The control API (gemini_sidecar.api) drives the parts."""

    def __init__(self, cfg: SidecarConfig) -> None:
        self.cfg = cfg
        self.placement: Placement = cfg.placement
        self.metrics: SidecarMetrics = make_metrics(cfg.namespace, cfg.job, cfg.rank)
        self.metrics.memory_budget.set(cfg.memory_budget_bytes)
        self.store = ReplicaStore(cfg.memory_budget_bytes)
        self.local = LocalShard(cfg.shm_dir, cfg.rank, cfg.job)
        self.pushed_profile: Profile | None = None
        self.replicator = Replicator(
            cfg, self.local, self.metrics, lambda: self.placement, self.profile
        )
        self.server = PeerServer(
            ServerContext(
                job=cfg.job, token=cfg.auth_token, rank=cfg.rank,
                max_payload=cfg.max_frame_bytes, store=self.store, local=self.local,
                metrics=self.metrics, hold_ranks=lambda: self.placement.hold_ranks,
                peer_of=lambda rank: self.placement.peers.get(rank),
                peers=lambda: self.placement.peers,
                on_change=self._refresh_gauges, limits=cfg.limits,
                check_senders=cfg.check_senders, encrypt=cfg.peer_encryption,
            )
        )
        self.pulls = Pulls(cfg, self.local, self.store, self.replicator, self.metrics,
                           lambda: self.placement, self._refresh_gauges)
        self.checkpoints = S3Checkpoints(cfg, self.local, self.metrics)
        self.transfers = Transfers()
        self.peer_port = 0
        self.api_port = 0
        self.probe_port: int | None = None
        self._probes: ProbeListener | None = None
        self._runner: web.AppRunner | None = None
        self._api: ApiListener | None = None

    async def start(self) -> None:
        self.local.unpin()  # a pin left by a previous run's upload: a persist pins it again
        self.peer_port = await self.server.start(self.cfg.bind_host, self.cfg.peer_port)
        self.replicator.start()  # a restarted sidecar's check sends the unacknowledged newest
        # aiohttp's keep-alive timer also runs from a connection's start until its first
        # request header is complete: at the header timeout it closes a stalled one
        self._runner = web.AppRunner(make_app(self), access_log=None,
                                     keepalive_timeout=self.cfg.limits.header_timeout_s)
        await self._runner.setup()
        self._api = ApiListener(self._runner, self.cfg.limits, self.metrics,
                                trusted=self.server.known.has)
        self.api_port = await self._api.start(self.cfg.bind_host, self.cfg.api_port)
        if self.cfg.probe_port is not None:
            self._probes = ProbeListener({paths.HEALTHZ_PATH: lambda: health_of(self)},
                                         "probes", self.metrics.api_refused)
            self.probe_port = await self._probes.start(self.cfg.bind_host, self.cfg.probe_port)
        log.info("sidecar rank %d of job %s: peers on %s:%d (%s), API on %s:%d", self.cfg.rank,
                 self.cfg.job, self.cfg.bind_host, self.peer_port,
                 "encrypted" if self.cfg.peer_encryption else "not encrypted",
                 self.cfg.bind_host, self.api_port)

    async def stop(self) -> None:
        uploads_ended = await self.checkpoints.stop()
        await self.transfers.stop()
        await self.replicator.stop()
        await self.server.stop()
        if self._api is not None:
            await self._api.stop()
        if self._probes is not None:
            await self._probes.stop()
        if self._runner is not None:
            await self._runner.cleanup()
        if uploads_ended:  # else an upload may still read the slot file's mapping
            self.local.close()

    # -- state -------------------------------------------------------------------------------
    def listener_health(self) -> dict[str, ListenerHealth]:
        """Every listener's real state (/healthz)."""
        api = self._api.health() if self._api is not None else ListenerHealth(
            "dead", "not started", healthy=False)
        return {"peer": self.server.health(), "api": api}

    def refuse_call(self, peer: str, reason: str) -> None:
        """Log and count an API call refused (no token); never with what it sent."""
        if self._api is not None:
            self._api.refusals.refuse(peer, reason)

    def profile(self) -> Profile | None:
        """The traffic profile pushed over the API, else the one the trainer wrote in shm."""
        if self.cfg.traffic_mode == "immediate":
            return None
        return self.pushed_profile or load_profile(
            profile_path(self.cfg.shm_dir, self.cfg.rank, self.cfg.job)
        )

    def set_placement(self, placement: Placement) -> None:
        """A new placement; the same one again changes nothing (a recovery that polls posts
        it on every poll: restarting sends each time would abandon them over and over)."""
        if placement == self.placement:
            return
        for rank in self.store.held_ranks():
            if rank not in placement.hold_ranks:
                self.store.drop(rank)
        self.placement = placement
        self.replicator.placement_changed()
        self.server.known.changed()
        self._refresh_gauges()

    def _refresh_gauges(self) -> None:
        self.metrics.memory_used.set(self.store.used_bytes)
        self.metrics.replicas_held.set(len(self.store.held_ranks()))
        done = {i.rank for i in self.store.inventory() if i.complete}
        self.metrics.replicas_complete.set(len(done))

    def notify(self, version: int, stall_seconds: float | None) -> None:
        if stall_seconds is not None:
            self.metrics.snapshot_stall.observe(stall_seconds)
        self.metrics.latest_local_version.set(version)
        self.checkpoints.notified(version)
        self.replicator.notify(version)


async def serve_forever(cfg: SidecarConfig) -> None:
    """Run a sidecar until SIGTERM/SIGINT; prints one JSON line with the bound ports."""
    raise_fd_limit()
    sidecar = Sidecar(cfg)
    await sidecar.start()
    print(json.dumps({"event": "ready", "rank": cfg.rank, "peer_port": sidecar.peer_port,
                      "api_port": sidecar.api_port, "probe_port": sidecar.probe_port}),
          flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    log_accept_errors_once(loop, "sidecar")
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await sidecar.stop()
        log.info("sidecar rank %d stopped", cfg.rank)
