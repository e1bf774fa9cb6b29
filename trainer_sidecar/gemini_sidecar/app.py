"""The sidecar process: peer server, replicator, replica store, S3 and the control API."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import resource
import signal
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from aiohttp import web

from gemini.control.transfers import (
    CommitAnswer,
    CommittedStepsAnswer,
    PersistAnswer,
    ReplicaFetch,
    RestoreAnswer,
)
from gemini_sidecar import s3 as s3mod
from gemini_sidecar import uploads
from gemini_sidecar.config import (
    PeerAddress,
    Placement,
    ServerLimits,
    SidecarConfig,
    parse_address,
)
from gemini_sidecar.fetcher import Fetched, FetchRequest, fetch
from gemini_sidecar.local import LocalShard, LocalShardError
from gemini_sidecar.metrics import SidecarMetrics, make_metrics
from gemini_sidecar.pacing import Profile, load_profile, profile_path
from gemini_sidecar.peer_client import FetchFailed
from gemini_sidecar.peer_server import (
    LISTEN_BACKLOG,
    ConnectionGate,
    ListenerHealth,
    PeerServer,
    RefusalLog,
    ServerContext,
    address_of,
    host_of,
)
from gemini_sidecar.replicator import Replicator
from gemini_sidecar.store import ReplicaStore, StoreError
from gemini_sidecar.transfers import Progress, Transfers
from gemini_trainer.shm import SlotInfo

log = logging.getLogger(__name__)
# File descriptors this process asks for (up to the hard limit): each peer connection takes
# two, so the default soft limit of 1024 is near the connection limits of both listeners.
T = TypeVar("T")
WANTED_FDS = 65536
ACCEPT_ERROR_QUIET_S = 60.0
UPLOAD_STOP_S = 10.0  # for the parts in flight of a stopping upload (64 MiB each by default)


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


class Sidecar:
    """One rank's checkpoint sidecar. `start()` binds both servers; `stop()` releases them."""

    def __init__(self, cfg: SidecarConfig) -> None:
        self.cfg = cfg
        self.placement: Placement = cfg.placement
        self.metrics: SidecarMetrics = make_metrics(cfg.job, cfg.rank)
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
                on_change=self._refresh_gauges, limits=cfg.limits,
                check_senders=cfg.check_senders, encrypt=cfg.peer_encryption,
            )
        )
        self.s3 = s3mod.open_store(cfg.s3) if cfg.s3 else None
        self.identity = s3_identity(cfg)
        self._refused_steps: set[tuple[int, str]] = set()
        self.transfers = Transfers()
        # the last upload that finished: (version, slot seq, CRC-32) and its answer
        self._persisted: tuple[tuple[int, int, int], PersistAnswer] | None = None
        # Set by stop(): uploads start no new part. Their threads are awaited by the event
        # loop's shutdown, so a long upload would keep a finished pod alive until SIGKILL.
        self._stopping = threading.Event()
        self._uploading: set[asyncio.Future[Any]] = set()
        if self.s3 is not None and not cfg.job_uid:
            log.warning("GEMINI_JOB_UID is unset: S3 checkpoints of job %s go under uid %s, "
                        "shared with any other job of that namespace and name started so",
                        cfg.job, s3mod.NO_UID)
        self.peer_port = 0
        self.api_port = 0
        self._runner: web.AppRunner | None = None
        self._api: ApiListener | None = None

    async def start(self) -> None:
        from gemini_sidecar.api import make_app  # the API module builds on this class

        self.local.unpin()  # a pin left by a previous run's upload: a persist pins it again
        self.peer_port = await self.server.start(self.cfg.bind_host, self.cfg.peer_port)
        self.replicator.start()  # a restarted sidecar's check sends the unacknowledged newest
        # aiohttp's keep-alive timer also runs from a connection's start until its first
        # request header is complete: at the header timeout it closes a stalled one
        self._runner = web.AppRunner(make_app(self), access_log=None,
                                     keepalive_timeout=self.cfg.limits.header_timeout_s)
        await self._runner.setup()
        self._api = ApiListener(self._runner, self.cfg.limits, self.metrics)
        self.api_port = await self._api.start(self.cfg.bind_host, self.cfg.api_port)
        log.info("sidecar rank %d of job %s: peers on %s:%d (%s), API on %s:%d", self.cfg.rank,
                 self.cfg.job, self.cfg.bind_host, self.peer_port,
                 "encrypted" if self.cfg.peer_encryption else "not encrypted",
                 self.cfg.bind_host, self.api_port)

    async def stop(self) -> None:
        self._stopping.set()
        if self._uploading:  # each ends after its parts in flight
            await asyncio.wait(set(self._uploading), timeout=UPLOAD_STOP_S)
        stuck = bool(self._uploading)
        if stuck:
            log.warning("stopping with an S3 upload whose parts in flight did not end within "
                        "%.0f s; it is resumed by a later persist of that version",
                        UPLOAD_STOP_S)
        await self.transfers.stop()
        await self.replicator.stop()
        await self.server.stop()
        if self._api is not None:
            await self._api.stop()
        if self._runner is not None:
            await self._runner.cleanup()
        if not stuck:  # else the upload may still read the slot file's mapping
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
        if self._persisted is not None and version <= self._persisted[0][0]:
            self._persisted = None  # a restart from an older step: that upload is history
        self.replicator.notify(version)

    def holders_for(self, rank: int, given: Sequence[int | str] | None) -> list[PeerAddress]:
        """Holder addresses: given as ranks (looked up in the peer map) or host:port."""
        if not given:
            given = [rank] if rank != self.cfg.rank else []
        out = []
        for item in given:
            if isinstance(item, int):
                if item not in self.placement.peers:
                    raise ValueError(f"no peer address for rank {item}; POST /peers first")
                out.append(self.placement.peers[item])
            else:
                out.append(parse_address(item))
        if not out:
            raise ValueError(f"name the holders of rank {rank} to fetch it from")
        return out

    # -- fetch -------------------------------------------------------------------------------
    async def fetch(
        self, rank: int, version: int | None, holders: list[PeerAddress], into: str,
        progress: Progress | None = None,
    ) -> Fetched:
        """Pull (rank, version) from holders into local shm (own rank) or the replica store."""
        req = FetchRequest(self.cfg.job, self.cfg.auth_token, self.cfg.max_frame_bytes, rank,
                           version, holders, self.cfg.chunk_bytes,
                           encrypt=self.cfg.peer_encryption)
        progress = progress if progress is not None else Progress()
        started = time.perf_counter()
        if into == "shm":
            result = await self._fetch_into_shm(req, progress)
        else:
            result = await self._fetch_into_store(req, progress)
        self.metrics.fetch_seconds.observe(time.perf_counter() - started)
        return result

    async def _fetch_into_shm(self, req: FetchRequest, progress: Progress) -> Fetched:
        if req.rank != self.cfg.rank:
            raise ValueError(f"only this sidecar's own rank {self.cfg.rank} goes into shm")
        opened: list[Any] = []

        def allocate(version: int, length: int, crc: int) -> memoryview:
            slots, view = self.local.begin_write(version, length)
            opened.append(slots)
            return view

        try:
            result = await fetch(req, allocate, self.metrics, progress)
        except BaseException:
            for slots in opened[-1:]:
                slots.abort()
            raise
        info = opened[-1].commit(result.version, result.checksum)
        self.replicator.seen(info.seq)  # fetched from its holders: nothing to send
        self.metrics.latest_local_version.set(result.version)
        return result

    async def _fetch_into_store(self, req: FetchRequest, progress: Progress) -> Fetched:
        if req.rank not in self.placement.hold_ranks:
            raise ValueError(f"rank {req.rank} is not among the ranks this sidecar holds "
                             f"{list(self.placement.hold_ranks)}; POST /peers first")

        def allocate(version: int, length: int, crc: int) -> memoryview:
            self.store.begin(req.rank, version, length, crc)
            return self.store.chunk_view(req.rank, version, 0, length)

        result = await fetch(req, allocate, self.metrics, progress)
        # fetch() checked the whole payload against its CRC-32: one piece with that CRC
        self.store.chunk_done(req.rank, result.version, 0, result.length, result.checksum)
        self.store.finish(req.rank, result.version, result.checksum)
        self._refresh_gauges()
        return result

    async def refill(self, holders: Mapping[int, Sequence[int | str]], version: int | None = None,
                     progress: Progress | None = None) -> tuple[ReplicaFetch, ...]:
        """Pull `version` (default: the newest complete) of every held rank (a replacement
        sidecar does this after its own shard; a recovery names the version it restores, which
        its owner may have newer ones of, and then every holder has it): from the holders given
        per rank, else from that rank's own sidecar. A rank whose `version` is already complete
        here is kept as it is. One failed rank does not stop the others; each gets its result
        or error."""
        results: list[ReplicaFetch] = []
        for rank in self.placement.hold_ranks:
            held = self._complete_replica(rank, version)
            if held is not None:  # already here: fetching again would overwrite this copy
                results.append(ReplicaFetch(rank, version, held, ()))
                continue
            try:
                got = await self.fetch(rank, version, self.holders_for(rank, holders.get(rank)),
                                       "store", progress)
            except (FetchFailed, ValueError, StoreError) as err:
                results.append(ReplicaFetch(rank, error=str(err)))
                continue
            results.append(ReplicaFetch(rank, got.version, got.length, got.holders_used))
        return tuple(results)

    # -- whether a finished transfer still holds (gemini_sidecar.transfers) -----------------
    def has_local(self, version: int, checksum: int | None = None) -> bool:
        """Whether a slot holds `version` complete (with that CRC-32, when given)."""
        return any(i.version == version and i.complete and checksum in (None, i.checksum)
                   for i in self.local.slot_info())

    def has_replica(self, rank: int, version: int | None, checksum: int | None = None) -> bool:
        """Whether the store holds `version` of `rank` complete (with that CRC-32)."""
        return self._complete_replica(rank, version, checksum) is not None

    def still_fetched(self, into: str) -> Callable[[Fetched], bool]:
        if into == "shm":
            return lambda got: self.has_local(got.version, got.checksum)
        return lambda got: self.has_replica(got.rank, got.version, got.checksum)

    def still_refilled(self, results: Sequence[ReplicaFetch]) -> bool:
        return all(r.ok and self.has_replica(r.rank, r.version) for r in results)

    def _complete_replica(self, rank: int, version: int | None,
                          checksum: int | None = None) -> int | None:
        """The size of `version` of `rank` if the store holds it complete (with that CRC-32,
        when given), else None."""
        if version is None:
            return None
        return next((c.bytes for c in self.store.inventory()
                     if c.rank == rank and c.version == version and c.complete
                     and checksum in (None, c.checksum)), None)

    # -- S3 ----------------------------------------------------------------------------------
    def _need_s3(self) -> s3mod.S3Store:
        if self.s3 is None:
            raise ValueError("S3 is not configured: set GEMINI_S3_BUCKET (and endpoint/keys)")
        return self.s3

    async def persist(self, version: int | None, progress: Progress | None = None
                      ) -> PersistAnswer:
        """Upload a version of the own shard, resuming an unfinished upload of it
        (gemini_sidecar.uploads). The version is pinned in the slot file only while it is
        copied aside (stage_copy): the trainers go on checkpointing into both slots during the
        upload. A version uploaded last is answered from the note of that upload (a retry
        after the answer was lost)."""
        store = self._need_s3()
        progress = progress if progress is not None else Progress()
        try:
            info, data = self.local.read(version)
        except LocalShardError:
            # Asked again after the trainers reused its slot (ranks' uploads can end a minute
            # apart on a slow S3, longer than a finished transfer answers for itself).
            earlier = self._upload_of_reused_slot(version)
            if earlier is None:
                raise
            return earlier
        done = self._persisted
        # the same slot write (a restart from an older step writes its versions again)
        if done is not None and done[0] == (info.version, info.seq, info.checksum):
            return done[1]
        progress.expect(len(data))
        if not self.local.pin(info):
            raise ValueError(f"version {info.version} was overwritten before its upload began; "
                             "persist a newer version")
        started = time.perf_counter()
        pinned = True
        try:
            staged = await asyncio.to_thread(uploads.stage_copy, data)
            if staged is not None:  # else no memory for a copy: upload from the pinned slot
                if not self.local.still_valid(info):
                    raise ValueError(f"version {info.version} was overwritten while it was "
                                     "copied for its upload; persist a newer version")
                data, pinned = staged, False
                self.local.unpin(info)
            sent = await self._upload(store, info, data, progress)
        except Exception:
            self.metrics.s3_failures.inc()
            raise
        finally:
            if pinned:
                self.local.unpin(info)
        key = sent.key
        self.metrics.s3_parts_sent.inc(sent.sent)
        if pinned and not self.local.still_valid(info):
            self.metrics.s3_failures.inc()
            raise ValueError(f"version {info.version} was overwritten during the upload; "
                             "persist a newer version")
        seconds = time.perf_counter() - started
        self.metrics.s3_persist_seconds.observe(seconds)
        answer = PersistAnswer(key, info.version, len(data), seconds, info.checksum)
        self._persisted = ((info.version, info.seq, info.checksum), answer)
        return answer

    async def _upload(self, store: s3mod.S3Store, info: SlotInfo, data: memoryview,
                      progress: Progress) -> uploads.Uploaded:
        """The upload on a daemon thread that stop() ends and waits for, for a while: a part
        S3 never answers must not keep the process from exiting (the event loop's shutdown
        joins its executor's threads, the interpreter every pool's)."""
        future = in_daemon_thread(functools.partial(
            s3mod.persist_pinned, store, self.identity, info.version, self.cfg.rank, data,
            info.checksum, info.seq, self._upload_state_path(), progress.add, self._stopping))
        self._uploading.add(future)
        future.add_done_callback(_forget(self._uploading))
        return await asyncio.shield(future)  # a cancelled request leaves the upload to stop()

    def _upload_of_reused_slot(self, version: int | None) -> PersistAnswer | None:
        """The last upload's answer if it was of `version` and the slot file holds only
        versions written after it, each newer: no restart from an older step rewrote
        `version` since (notify forgets the upload when one does)."""
        if self._persisted is None or self._persisted[0][0] != version:
            return None
        (_, seq, _), answer = self._persisted
        complete = [i for i in self.local.slot_info() if i.complete]
        newer = bool(complete) and all(i.version > version and i.seq > seq for i in complete)
        return answer if newer else None

    def _upload_state_path(self) -> Path:
        # On the pod's memory volume, next to the slot file: it outlives a sidecar restart.
        return self.local.path.with_name(self.local.path.name + ".upload.json")

    async def commit(self, version: int) -> CommitAnswer:
        store = self._need_s3()
        retain = self.cfg.s3.retain if self.cfg.s3 else 3
        key = await asyncio.to_thread(
            s3mod.commit_checkpoint, store, self.identity, version, self.cfg.world_size
        )
        deleted = await asyncio.to_thread(s3mod.apply_retention, store, self.identity, retain)
        return CommitAnswer(key, version, tuple(deleted))

    async def committed_steps(self) -> CommittedStepsAnswer:
        """The steps committed to S3 by this job (its namespace, name and uid)."""
        refused: dict[int, str] = {}
        steps = await asyncio.to_thread(s3mod.committed_steps, self._need_s3(), self.identity,
                                        refused)
        for version, reason in sorted(refused.items()):
            self._refuse_step(version, f"step {version} is not listed as committed: {reason}")
        return CommittedStepsAnswer(tuple(steps))

    async def restore_from_s3(self, version: int | None, progress: Progress | None = None
                              ) -> RestoreAnswer:
        """Download this rank's object of a committed step of this job into local shm."""
        store = self._need_s3()
        progress = progress if progress is not None else Progress()
        if version is None:
            version = await asyncio.to_thread(s3mod.latest_committed, store, self.identity)
            if version is None:
                raise ValueError(f"no committed checkpoint of job {self.identity} in S3")
        marker = await asyncio.to_thread(s3mod.read_marker, store, self.identity, version)
        try:
            s3mod.check_marker(marker, self.identity, version, self.cfg.world_size)
        except s3mod.ForeignCheckpoint as err:
            self._refuse_step(version, str(err))
            raise
        entry = marker["ranks"][str(self.cfg.rank)]
        length, crc = int(entry["bytes"]), int(entry["crc32"])
        progress.expect(length)
        slots, view = self.local.begin_write(version, length)
        started = time.perf_counter()
        try:
            await asyncio.to_thread(
                s3mod.download_shard, store, self.identity, version, self.cfg.rank, view, crc,
                progress.add)
        except BaseException:
            self.metrics.s3_failures.inc()
            slots.abort()
            raise
        slots.commit(version, crc)
        seconds = time.perf_counter() - started
        self.metrics.s3_restore_seconds.observe(seconds)
        return RestoreAnswer(version, length, seconds)

    def _refuse_step(self, version: int, reason: str) -> None:
        """Log a refused S3 step once (a caller retrying must not flood the log)."""
        if (version, reason) not in self._refused_steps:
            self._refused_steps.add((version, reason))
            log.warning("S3 of job %s: %s", self.identity, reason)


def in_daemon_thread(call: Callable[[], T]) -> asyncio.Future[T]:
    """`call()` on a daemon thread of its own, as a future of the running loop."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(outcome: Callable[[], None]) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
            loop.call_soon_threadsafe(outcome)

    def finish(result: Any, error: BaseException | None) -> None:
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    def run() -> None:
        try:
            result, error = call(), None
        except BaseException as err:  # handed to the awaiting coroutine
            result, error = None, err
        settle(functools.partial(finish, result, error))

    threading.Thread(target=run, name="gemini-s3-upload", daemon=True).start()
    return future


def _forget(running: set[asyncio.Future[Any]]) -> Callable[[asyncio.Future[Any]], None]:
    def done(future: asyncio.Future[Any]) -> None:
        running.discard(future)
        if not future.cancelled():
            future.exception()  # read here: its request may have gone (no unread-error log)
    return done


def s3_identity(cfg: SidecarConfig) -> s3mod.JobIdentity:
    """Whose S3 checkpoints this sidecar writes and reads (see gemini_sidecar.s3)."""
    return s3mod.JobIdentity(cfg.namespace, cfg.job, cfg.job_uid or s3mod.NO_UID)


async def serve_forever(cfg: SidecarConfig) -> None:
    """Run a sidecar until SIGTERM/SIGINT; prints one JSON line with the bound ports."""
    raise_fd_limit()
    sidecar = Sidecar(cfg)
    await sidecar.start()
    print(json.dumps({"event": "ready", "rank": cfg.rank, "peer_port": sidecar.peer_port,
                      "api_port": sidecar.api_port}), flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    log_accept_errors_once(loop)
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await sidecar.stop()
        log.info("sidecar rank %d stopped", cfg.rank)


def raise_fd_limit() -> None:
    """Raise the soft file descriptor limit towards the hard one (WANTED_FDS at most)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = WANTED_FDS if hard == resource.RLIM_INFINITY else min(WANTED_FDS, hard)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))


def log_accept_errors_once(loop: asyncio.AbstractEventLoop) -> None:
    """asyncio's servers (the API's) retry a failed accept (out of file descriptors) every
    second and report each failure to the loop: log the first of a run only, like the peer
    server, instead of a line a second while it lasts."""
    last_logged = -ACCEPT_ERROR_QUIET_S

    def handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        nonlocal last_logged
        if context.get("message") != "socket.accept() out of system resource":
            loop.default_exception_handler(context)
            return
        if time.monotonic() - last_logged >= ACCEPT_ERROR_QUIET_S:
            last_logged = time.monotonic()
            log.error("API: cannot accept connections (%s); retrying every second, logged "
                      "again after %g s at the earliest", context.get("exception"),
                      ACCEPT_ERROR_QUIET_S)

    loop.set_exception_handler(handler)
