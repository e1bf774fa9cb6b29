"""What the operator learns from the sidecars and launchers of running jobs, every few seconds.

`CheckpointPoller.poll(key)` reads every sidecar's inventory (the newest step complete in
memory for every rank, how many shards have all their replicas complete, and the trainer's
last heartbeat for hang detection; from sidecars that do not carry it, every launcher's
progress is read instead), and, when a job
persists to S3, has every sidecar upload that step and rank 0's sidecar commit it every
`persistence.intervalSeconds` or when the annotation `gemini.io/persist-requested` gets a new
value. It runs off the reconcile path (a lost node's sidecar may take seconds to time out);
its findings are kept in memory and handed to the pure reconcile, which writes the status, so
the two never overwrite each other. S3 failures leave training running and are retried.

`PollRounds` polls every job side by side: the workers run images a job's author chooses, and
a slow or hostile one must cost only its own job, never the polling of the others.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from functools import partial
from typing import Any

from gemini.control.auth import Bearer
from gemini.control.inventory import Inventory
from gemini.control.launcher import Progress as Heartbeat
from gemini_operator.calls import placement_delivery, sidecars
from gemini_operator.calls.sidecars import (
    DeliveryError,
    SidecarError,
    TransfersRunning,
    persist_and_commit,
    worker_ports,
)
from gemini_operator.calls.tokens import JobTokens
from gemini_operator.cluster.cache import ClusterCache, JobKey
from gemini_operator.cluster.kube import KubeClient
from gemini_operator.core.apitime import api_time, parse_api_time
from gemini_operator.core.conditions import FINISHED_TYPES, ConditionType, is_true
from gemini_operator.core.decide import training_started
from gemini_operator.core.failures import Progress
from gemini_operator.core.fairness import FairQueue
from gemini_operator.core.observed import PodView
from gemini_operator.core.pace import replication_pace
from gemini_operator.core.silence import PRESUME_S, SilenceTracker, suspects
from gemini_operator.core.spec import JobSpec, Persistence, SpecError, parse_spec
from gemini_operator.core.status import (
    CheckpointStatus,
    JobStatus,
    PersistProgress,
    ReplicaCoverage,
)
from gemini_operator.core.types import JobView, ReconcileConfig

log = logging.getLogger(__name__)
POLL_SECONDS = 2.0
POLL_TIMEOUT_SECONDS = 2.0
PERSIST_TIMEOUT_SECONDS = 300.0  # the commit (it reads every rank's object's head)
PERSIST_WAIT_SECONDS = 0.5  # each poll joins the uploads under way for this long at most
PERSIST_RETRY_SECONDS = 10.0
PERSIST_ANNOTATION = "gemini.io/persist-requested"
# Jobs polled at once. A job is never polled twice at a time, so a job whose workers hold
# every call to its deadline holds one of these threads; the others keep polling.
POLL_WORKERS = 16
PROBE_TIMEOUT_SECONDS = 1.0  # a TCP connect to a silent pod's ports (silence.py)


@dataclass(frozen=True)
class Findings:
    """The latest word from one job's workers."""

    checkpoint: CheckpointStatus
    progress: Progress | None = None
    epoch: int | None = None  # the launch epoch `progress` was seen in
    presumed_lost: frozenset[str] = frozenset()  # nodes whose pods fell silent (silence.py)
    # Ranks whose training failed in the launch epoch while their launcher stays up for the
    # next (gemini_trainer.inprocess), with what failed (the launcher's words); `exits`: those
    # whose process exited, with its code (the others are alive, parked).
    parked: Mapping[int, str] = field(default_factory=dict)
    exits: Mapping[int, int] = field(default_factory=dict)
    # When each parked rank's launcher recorded the failure (its node's clock, as the API's
    # finishedAt is): the failure's time when no container stopped.
    parked_at: Mapping[int, datetime] = field(default_factory=dict)


def workers_to_poll(job_uid: str, status: JobStatus, pods: Mapping[int, PodView]
                    ) -> dict[int, PodView] | None:
    """The job's running workers of its current attempt, whose sidecars are asked each poll
    (not those done training: their sidecars are stopping); None when none are to be asked:
    training has not started, a recovery is under way, or the job finished (its pods keep
    their IPs, but their sidecars are gone)."""
    if (not training_started(status) or status.recovery is not None
            or is_true(status.conditions, ConditionType.RECOVERING)
            or any(is_true(status.conditions, kind) for kind in FINISHED_TYPES)):
        return None
    return {r: p for r, p in pods.items() if p.owner_uid == job_uid
            and p.attempt == status.restart_attempt and p.ip and not p.deleting
            and not p.terminal and not p.training_done}


def complete_in_memory(inventories: Mapping[int, Inventory], ranks: Sequence[int]
                       ) -> int | None:
    """The newest version every rank holds complete in its own memory (None: no such one)."""
    common: set[int] | None = None
    for rank in ranks:
        inventory = inventories.get(rank)
        versions = inventory.complete_versions() if inventory is not None else set()
        common = versions if common is None else common & versions
    return max(common) if common else None


def replica_coverage(inventories: Mapping[int, Inventory],
                     holders: Mapping[int, Sequence[int]]) -> ReplicaCoverage:
    """How many of the shards have every copy the placement asks for (`holders`: rank -> the
    ranks holding its shard, itself first) complete in memory, at the step where the most do
    (the newest on a tie). A holder missing from `inventories` (it did not answer) counts as
    missing its copies."""
    held: dict[tuple[int, int], set[int]] = {}  # (shard rank, step) -> holders complete
    for holder, inventory in inventories.items():
        for key in inventory.complete_copies():
            held.setdefault(key, set()).add(holder)
    best = ReplicaCoverage(0, len(holders))
    for step in sorted({v for _, v in held}):
        complete = sum(1 for rank, hs in holders.items()
                       if set(hs) <= held.get((rank, step), set()))
        if complete and complete >= best.complete:
            best = ReplicaCoverage(complete, len(holders), step)
    return best


def progress_of(beats: Mapping[int, Heartbeat | None], now: datetime,
                previous: Progress | None) -> Progress | None:
    """The job's newest step and since when it has been the newest (from the trainers'
    heartbeats, by rank; None: that rank's trainer sent none yet)."""
    known = [b for b in beats.values() if b is not None]
    if not known:
        return previous
    step = max(b.step for b in known)
    if previous is not None and previous.step == step:
        return previous
    age = min(b.age_s for b in known if b.step == step)
    return Progress(step, now - timedelta(seconds=age))


class CheckpointPoller:
    def __init__(self, kube: KubeClient, cache: ClusterCache, config: ReconcileConfig,
                 tokens: JobTokens,
                 clock: Callable[[], datetime] = lambda: datetime.now(UTC),
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self.kube, self.cache, self.config, self.tokens = kube, cache, config, tokens
        self._clock, self._monotonic = clock, monotonic
        self._silence: dict[JobKey, SilenceTracker] = {}
        self._found: dict[JobKey, Findings] = {}
        self._handled_request: dict[JobKey, str] = {}
        self._persist_tried: dict[JobKey, float] = {}
        self._persisting: dict[JobKey, tuple[int | None, int]] = {}  # (epoch, step) under way

    def findings(self, key: JobKey) -> Findings | None:
        found = self._found.get(key)
        if found is None or (found.progress is None and not found.parked):
            return found
        snap = self.cache.snapshot(key)
        epoch = _launch_epoch(JobStatus.from_dict(JobView.from_object(snap.job).status)) if (
            snap is not None) else None
        # Progress seen before a restart says nothing about the new epoch: its launchers
        # start over from a checkpoint, and the hang clock with them (from their first step).
        # Nor do the failures the launchers reported for the old epoch: it was recovered.
        return found if found.epoch == epoch else replace(found, progress=None, parked={},
                                                          exits={})

    def forget(self, key: JobKey) -> None:
        self._found.pop(key, None)
        self._silence.pop(key, None)
        self._handled_request.pop(key, None)
        self._persist_tried.pop(key, None)
        self._persisting.pop(key, None)

    def poll(self, key: JobKey) -> bool:
        """Refresh the findings of job `key`; True when they changed (reconcile it)."""
        snap = self.cache.snapshot(key)
        if snap is None:
            self.forget(key)
            return False
        job = JobView.from_object(snap.job)
        status = JobStatus.from_dict(job.status)
        pods = workers_to_poll(job.uid, status, snap.pods)
        if pods is None:
            return False
        try:
            spec = parse_spec(job.spec, self.config.default_sidecar_image)
        except SpecError:
            return False
        if len(pods) < spec.num_nodes:
            return False
        token = self.tokens.of(job.ref)
        if token is None:
            return False
        before = self._found.get(key)
        found = self._observe(key, job, status, pods, token, before)
        if spec.persistence is not None:
            found = self._persist(key, snap.job, spec, pods, token, found,
                                  _launch_epoch(status))
        self._found[key] = found
        return found != before

    def _observe(self, key: JobKey, job: JobView, status: JobStatus, pods: Mapping[int, PodView],
                 token: Bearer, before: Findings | None) -> Findings:
        old = before.checkpoint if before is not None else status.checkpoint
        ports = self.config.render
        # Typed: an answer of the wrong shape counts as silent instead of failing the poll.
        typed, silent = sidecars.inventories_each(
            {r: (p.ip, ports.sidecar_api_port) for r, p in pods.items()}, token,
            POLL_TIMEOUT_SECONDS)
        lost = self._lost_nodes(key, pods, typed)
        if silent:
            log.debug("inventory of %s/%s: %s", job.namespace, job.name, silent[:3])
            step = old.in_memory_step
        else:
            step = complete_in_memory(typed, sorted(pods))
        self._redeliver(job, status, pods, typed, token)
        epoch = _launch_epoch(status)
        previous = before.progress if before is not None and before.epoch == epoch else None
        placement = status.placement
        coverage = (replica_coverage(typed, placement.layout.holders) if placement is not None
                    else old.replica_coverage)
        progress = self._progress(pods, typed, token, previous)
        checkpoint = replace(old, in_memory_step=step if step is not None else
                             old.in_memory_step, replica_coverage=coverage)
        pace = None if silent else replication_pace(typed)
        if pace is not None:
            checkpoint = replace(
                checkpoint, recoverable_step=pace.recoverable_step,
                effective_interval=pace.effective_interval, interval_reason=pace.reason,
                replication_lag_steps=pace.lag_steps)
        down = {r: i.parked for r, i in typed.items()
                if i.parked is not None and i.parked.epoch == (epoch or 0)}
        return Findings(checkpoint, progress, epoch, lost,
                        parked={r: p.error for r, p in down.items()},
                        exits={r: p.exit_code or 1 for r, p in down.items()
                               if p.exit_code is not None},
                        parked_at={r: datetime.fromtimestamp(p.unix, UTC)
                                   for r, p in down.items()})

    def _progress(self, pods: Mapping[int, PodView], inventories: Mapping[int, Inventory],
                  token: Bearer, previous: Progress | None) -> Progress | None:
        """The training's progress: from the sidecars' inventories, which carry the
        trainers' heartbeats (one call per pod a poll), else (a sidecar that does not read
        the heartbeat, or did not answer) from every launcher."""
        if len(inventories) == len(pods) and all(i.heartbeat for i in inventories.values()):
            return progress_of({r: i.progress for r, i in inventories.items()}, self._clock(),
                               previous)
        ports = self.config.render
        try:
            statuses = sidecars.launcher_statuses(
                {r: (p.ip, ports.launcher_port) for r, p in pods.items()}, token,
                POLL_TIMEOUT_SECONDS)
        except SidecarError:
            return previous
        return progress_of({r: s.progress for r, s in statuses.items()}, self._clock(),
                           previous)

    def _lost_nodes(self, key: JobKey, pods: Mapping[int, PodView],
                    answering: Mapping[int, Inventory]) -> frozenset[str]:
        """Nodes whose pods fell silent as only a lost node's do (silence.py), presumed lost
        in the cache so that every reconcile sees them not ready."""
        tracker = self._silence.setdefault(key, SilenceTracker())
        tracker.keep_only(pods.values())
        tracker.heard(pods[r] for r in answering)
        self.cache.heard_from(pods[r].uid for r in answering)
        probe = suspects(pods, answering, self.cache.has_answered)
        if not probe:
            return frozenset()
        down = sidecars.refusing(worker_ports(probe, self.config.render), PROBE_TIMEOUT_SECONDS)
        now = self._monotonic()
        lost = tracker.silent_nodes(probe, down, now)
        for node, since in lost.items():
            log.warning("node %s presumed lost: pods of %s/%s there refuse connections for "
                        "%.1f s while the API shows them running", node, *key, now - since)
            self.cache.presume_lost(node, self._clock() - timedelta(seconds=now - since),
                                    PRESUME_S)
        return frozenset(lost)

    def _redeliver(self, job: JobView, status: JobStatus, pods: Mapping[int, PodView],
                   inventories: Mapping[int, Inventory], token: Bearer) -> None:
        """Give restarted sidecars their part of the current placement again."""
        placement = status.placement
        if placement is None or not placement.on({r: p.node_name for r, p in pods.items()}):
            return  # ranks moved: the reconcile delivers the new placement to everyone
        ports = self.config.render
        stale = placement_delivery.stale_ranks(placement.layout, pods, ports, inventories)
        if not stale:
            return
        log.info("re-delivering the placement of %s/%s to the restarted sidecars of ranks %s",
                 job.namespace, job.name, stale)
        try:
            placement_delivery.deliver(placement.layout, pods, ports, token, ranks=stale)
        except DeliveryError as err:
            log.warning("re-delivering the placement of %s/%s: %s", job.namespace, job.name,
                        err)

    def _persist(self, key: JobKey, obj: Mapping[str, Any], spec: JobSpec,
                 pods: Mapping[int, PodView], token: Bearer, found: Findings,
                 epoch: int | None) -> Findings:
        """Start an upload when one is due, or join the one under way (each poll asks again,
        so no poll waits for a whole upload); commit once every rank's is in S3."""
        persistence: Persistence = spec.persistence  # type: ignore[assignment]
        ckpt = found.checkpoint
        request = ((obj.get("metadata") or {}).get("annotations") or {}).get(PERSIST_ANNOTATION)
        under_way = self._persisting.get(key)
        due = under_way[1] if under_way is not None and under_way[0] == epoch else (
            self._persist_due(key, persistence, ckpt, request))
        if due is None:
            return found
        version = due
        self._persisting[key] = (epoch, version)
        port = self.config.render.sidecar_api_port
        try:
            persist_and_commit({r: (p.ip, port) for r, p in pods.items()}, token, version,
                               PERSIST_TIMEOUT_SECONDS, wait=PERSIST_WAIT_SECONDS)
        except TransfersRunning as running:
            done, total = running.bytes_done()
            return replace(found, checkpoint=replace(
                ckpt, persist_progress=PersistProgress(version, done, total)))
        except SidecarError as err:
            del self._persisting[key]
            log.warning("persisting step %s of %s/%s failed (retrying): %s", version, *key, err)
            return replace(found, checkpoint=replace(
                ckpt, persist_error=f"step {version}: {err}"[:1024], persist_progress=None))
        del self._persisting[key]
        if request:
            self._handled_request[key] = request
        stamp = api_time(self._clock())
        log.info("persisted step %s of %s/%s to %s", version, *key, persistence.uri)
        return replace(found, checkpoint=replace(
            ckpt, persisted_step=version, persisted_time=stamp, persist_error=None,
            persist_request=request or ckpt.persist_request, persist_progress=None))

    def _persist_due(self, key: JobKey, persistence: Persistence, ckpt: CheckpointStatus,
                     request: str | None) -> int | None:
        """The step to upload now (the newest complete in memory), if one is due: asked for
        by the annotation, or the interval passed (failures retried every few seconds)."""
        version = ckpt.in_memory_step
        requested = bool(request) and self._handled_request.get(key) != request
        now = self._clock().timestamp()
        last = _unix(ckpt.persisted_time)
        due = requested or last is None or now - last >= persistence.interval_seconds
        if version is None or not due or (version == ckpt.persisted_step and not requested):
            return None
        if now - self._persist_tried.get(key, 0.0) < PERSIST_RETRY_SECONDS and not requested:
            return None
        self._persist_tried[key] = now
        return version


class PollRounds:
    """Polls jobs side by side, so a job whose workers are slow or hostile costs only itself.
    Each round (`start`) polls every job not still being polled from its last round, in a
    pool of its own: never the event loop's default executor, which the reconciles share.
    Namespaces take turns for the pool's workers (core.fairness), none holding more than
    `workers - 1` of them, so one tenant's many or slow jobs cannot delay another's polls.
    `changed(key)` runs on the event loop for each job whose findings changed."""

    def __init__(self, poll: Callable[[JobKey], bool], changed: Callable[[JobKey], None],
                 workers: int = POLL_WORKERS,
                 observe: Callable[[float], None] = lambda seconds: None) -> None:
        self._poll, self._changed, self._observe = poll, changed, observe
        self._workers = workers
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="poll")
        self._waiting: FairQueue[str, JobKey] = FairQueue(max(1, workers - 1))
        self._polling: set[JobKey] = set()  # waiting for a worker or being polled
        self._busy = 0  # workers polling
        self._again: set[JobKey] = set()  # poll once more when the poll under way ends

    def start(self, keys: Iterable[JobKey], again: bool = False) -> None:
        """Start polling each of `keys` not still being polled (call on the event loop).
        `again`: a key still being polled is polled once more right after (a failure hint:
        the poll under way may have read the workers before the failure)."""
        for key in keys:
            if key in self._polling:
                if again and key not in self._waiting:
                    self._again.add(key)
                continue  # still in its last poll: it waits for itself, nobody else does
            self._polling.add(key)
            self._waiting.add(key[0], key)
        self._dispatch()

    def _dispatch(self) -> None:
        loop = asyncio.get_running_loop()
        while self._busy < self._workers:
            taken = self._waiting.take()
            if taken is None:
                return
            self._busy += 1
            future = loop.run_in_executor(self._pool, self._timed, taken[1])
            future.add_done_callback(partial(self._done, taken[1]))

    def _timed(self, key: JobKey) -> bool:
        started = time.monotonic()
        try:
            return self._poll(key)
        finally:
            self._observe(time.monotonic() - started)

    def _done(self, key: JobKey, future: asyncio.Future[bool]) -> None:
        self._polling.discard(key)
        self._busy -= 1
        self._waiting.done(key[0])
        if future.cancelled():
            self._again.discard(key)
            return
        error = future.exception()
        if error is not None:  # one job's trouble must not stop the others' polling
            log.warning("polling %s/%s failed: %s", *key, error)
        elif future.result():
            self._changed(key)
        if key in self._again:
            self._again.discard(key)
            self.start([key])
        else:
            self._dispatch()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _launch_epoch(status: JobStatus) -> int | None:
    return status.launch.epoch if status.launch is not None else None


def _unix(text: str | None) -> float | None:
    when = parse_api_time(text)
    return None if when is None else when.timestamp()
