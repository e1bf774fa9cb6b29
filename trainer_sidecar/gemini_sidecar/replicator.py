"""Sends each new local version to this rank's peers (m-1 of them), one task per peer.

Once every peer has a version, it is acknowledged in the slot file (`LocalShard.acknowledge`):
only then may the trainer overwrite its older slot, so the newest version that every holder
has always survives (the trainers skip a snapshot together while it is not acknowledged,
which stretches the checkpoint interval; the inventory says by how much). Notifications
coalesce: if versions arrive faster than they can be sent, the newest one is sent next and
the ones in between are skipped. A send is void if the trainer reused the slot while it was
read.
A placement change abandons the send in flight (its peer may be a pod cut off by a partition,
which would hold it until the reply timeout) and sends that version again to the new peers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

from gemini.domain.traffic import LinkModel
from gemini.slots.layout import SlotInfo
from gemini_sidecar.config import Placement, SidecarConfig
from gemini_sidecar.local import LocalShard, LocalShardError
from gemini_sidecar.metrics import SidecarMetrics
from gemini_sidecar.pacing import Plans, Profile, plan
from gemini_sidecar.peer_client import SourceChanged, connect, send_version
from gemini_sidecar.peer_frames import PeerRefused, ProtocolError
from gemini_sidecar.protocol import Channel

log = logging.getLogger(__name__)
DEFAULT_LINK = LinkModel(alpha_seconds=50e-6, bandwidth_bytes_per_second=2.0 * (1 << 30))
# How often the slot file is checked for a newest version that is neither acknowledged nor on
# its way: its notice never came (a timed-out POST), the sidecar restarted, or its send failed
# (a peer cut off, then healed). The trainers wait for its acknowledgement and send no newer
# version meanwhile, so it is sent (again) from here.
CHECK_S = 2.0


@dataclass
class PeerState:
    acked_version: int = -1
    sending_version: int = -1
    last_error: str = ""
    last_seconds: float = 0.0


@dataclass
class ReplicationStatus:
    notified_version: int = -1
    skipped_versions: int = 0
    acknowledged_version: int = -1  # the newest own version every peer has
    effective_interval: int = 1  # steps between the last two versions the trainer wrote
    peers: dict[int, PeerState] = field(default_factory=dict)
    plan_reason: str = ""
    fits_idle_spans: bool = True
    interval_iterations: int | None = 1


class Replicator:
    def __init__(
        self,
        cfg: SidecarConfig,
        local: LocalShard,
        metrics: SidecarMetrics,
        placement: Callable[[], Placement],
        profile: Callable[[], Profile | None],
    ) -> None:
        self.cfg = cfg
        self.local = local
        self.metrics = metrics
        self._placement = placement
        self._profile = profile
        self.status = ReplicationStatus()
        self.link = DEFAULT_LINK
        self._wake = asyncio.Event()
        self._channels: dict[int, Channel] = {}
        self._task: asyncio.Task[None] | None = None
        self._sending: asyncio.Task[None] | None = None
        self._queued: int | None = None  # the version notified and not started yet
        self.idle = asyncio.Event()
        self.idle.set()
        self._seen_seq = 0  # newest slot on its way (or written here); lowered after a failure

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        for task in (self._task, self._sending):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        self._close_channels()

    def placement_changed(self) -> None:
        """After a placement change: drop peer connections (they may point at dead pods) and
        send the version in flight, or the newest one not yet acknowledged, to the new peers
        (the trainer keeps its older slot until then)."""
        if self._sending is not None and not self._sending.done():
            self._sending.cancel()
        self._seen_seq = 0  # nothing is on its way to the new peers
        self._send_unacknowledged(notice_may_come=False)
        self._close_channels()

    def _close_channels(self) -> None:
        for chan in self._channels.values():
            chan.close()
        self._channels.clear()

    def notify(self, version: int) -> None:
        if self._queued is not None:  # the version notified before has not started: superseded
            self.status.skipped_versions += 1
        previous = self.status.notified_version
        if 0 <= previous < version:
            self.status.effective_interval = version - previous
        if version < self.status.acknowledged_version:
            # Training went back (a restore of an older step): the versions acknowledged in
            # the abandoned run are no promise of the restored one's (status.checkpoint.
            # recoverableStep is the minimum over sidecars); the next acknowledgement says.
            self.status.acknowledged_version = -1
        self.status.notified_version = version
        self._queue(version)

    def _queue(self, version: int) -> None:
        self._queued = version
        self.idle.clear()
        self._wake.set()

    def seen(self, seq: int) -> None:
        """A slot the sidecar wrote itself (a fetch): its holders have it already."""
        self._seen_seq = max(self._seen_seq, seq)

    async def _run(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), CHECK_S)
            if not self._wake.is_set():
                self._send_unacknowledged(notice_may_come=True)
                if not self._wake.is_set():
                    continue
            self._wake.clear()
            version, self._queued = self._queued, None
            if version is not None:
                await self._replicate_once(version)
            if not self._wake.is_set():
                self.idle.set()

    def _send_unacknowledged(self, notice_may_come: bool) -> None:
        """Queue the trainer's newest version if it is neither acknowledged nor on its way
        (see CHECK_S); with `notice_may_come`, not before its notice had time to arrive."""
        newest = self.local.latest()
        if (self._queued is not None or newest is None or newest.seq <= self._seen_seq
                or newest.seq <= self.local.acknowledged_seq()):
            return
        if notice_may_come and time.time_ns() - newest.committed_unix_ns < CHECK_S * 1e9:
            return
        log.info("sending version %d: it is not acknowledged and no send of it is under way",
                 newest.version)
        self._queue(newest.version)

    async def _replicate_once(self, version: int) -> None:
        self._sending = asyncio.create_task(self._replicate(version))
        await asyncio.wait([self._sending])  # returns also when a placement change cancels it
        if self._sending.cancelled():
            log.info("sending of version %d abandoned: the placement changed; version %s goes "
                     "to the new peers", version, self._queued)
        elif (err := self._sending.exception()) is not None:
            # keep replicating later versions whatever went wrong here
            log.error("replication of version %d failed", version, exc_info=err)
        self._sending = None

    async def _replicate(self, version: int) -> None:
        targets = self._placement().send_to
        try:
            info, data = self.local.read(version)
        except LocalShardError as err:
            log.warning("cannot replicate: %s", err)
            return
        self.seen(info.seq)
        self.metrics.latest_local_version.set(info.version)
        plans = plan(len(data), len(targets), self.cfg.chunk_bytes, self._profile(), self.link)
        self._record_plan(plans)
        sends = [
            self._send_to_peer(rank, info.version, info.checksum, data, plans, i, info)
            for i, rank in enumerate(targets)
        ]
        try:
            await asyncio.gather(*sends)
        finally:
            data.release()
        self._update_lag(info.version, targets)
        if len(targets) >= self.cfg.replicas - 1 and all(
                self.status.peers[r].acked_version == info.version for r in targets):
            self.local.acknowledge(info)
            self.status.acknowledged_version = info.version
        elif any(self.status.peers[r].last_error for r in targets):
            self._seen_seq = min(self._seen_seq, info.seq - 1)  # the next check sends it again

    def _record_plan(self, plans: Plans) -> None:
        sched = plans.schedule
        self.status.plan_reason = sched.reason if sched else "immediate: all chunks at once"
        self.status.fits_idle_spans = sched.fits_idle_spans if sched else True
        self.status.interval_iterations = sched.interval_iterations if sched else 1

    async def _send_to_peer(
        self, rank: int, version: int, crc: int, data: memoryview, plans: Plans, copy: int,
        info: SlotInfo,
    ) -> None:
        peer = self.status.peers.setdefault(rank, PeerState())
        peer.sending_version = version
        started = time.perf_counter()
        try:
            chan = await self._channel(rank)
            sent = await send_version(chan, self.cfg.rank, version, data, crc,
                                      plans.per_copy[copy], partial(self.local.still_valid, info))
        except (PeerRefused, ProtocolError, SourceChanged, OSError, TimeoutError) as err:
            self._drop_channel(rank)
            peer.last_error = str(err)
            log.warning("sending version %d to rank %d failed: %s", version, rank, err)
            return
        finally:
            peer.sending_version = -1
        seconds = time.perf_counter() - started
        peer.acked_version, peer.last_error, peer.last_seconds = version, "", seconds
        self.metrics.replication_bytes.inc(sent)
        self.metrics.replication_seconds.observe(seconds)

    async def _channel(self, rank: int) -> Channel:
        chan = self._channels.get(rank)
        if chan is None:
            peers = self._placement().peers
            if rank not in peers:
                raise PeerRefused(f"no address for rank {rank} in the placement")
            addr = peers[rank]
            chan = await connect(addr, self.cfg.job, self.cfg.auth_token, self.cfg.max_frame_bytes,
                                 source=self.cfg.bind_host, encrypt=self.cfg.peer_encryption)
            self._channels[rank] = chan
        return chan

    def _drop_channel(self, rank: int) -> None:
        chan = self._channels.pop(rank, None)
        if chan is not None:
            chan.close()

    def _update_lag(self, version: int, targets: tuple[int, ...]) -> None:
        acked = [self.status.peers.get(r, PeerState()).acked_version for r in targets]
        newest_everywhere = min(acked, default=version)
        lag = version - newest_everywhere if newest_everywhere >= 0 else version + 1
        self.metrics.replication_lag.set(lag)
