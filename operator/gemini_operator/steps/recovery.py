"""Executing recoveries: the steps that talk to launchers and sidecars after a failure.

Level-based: every step of a recovery is written to status.recovery (epoch, phase, plan)
before it is acted on, and every action is idempotent (a launcher ignores an epoch it already
runs; a fetch or restore of the same version again is harmless; a pod that exists is not
created twice), so an operator restarted in the middle repeats the current phase and goes on.

Phases: Planning (read every live sidecar's inventory, plan with gemini.domain.recovery)
-> Replacing (lost ranks only: force-delete their pods, create replacements, wait until they
run) -> Fetching (replacements pull their shard and replicas from peers; or, for an S3 plan,
every sidecar restores the committed step) -> Restarting (every launcher starts the new epoch
with the plan's version and the epoch's rendezvous: rank 0's pod IP, a fresh port) -> done.
A phase that must wait (a pod not yet running, a launcher restarting) asks to be called again.
Planning never waits for a lost node's sidecar: one that refuses connections on both ports
although it answered before has its node presumed lost at once (silence.py), and the next
reconcile plans again with that rank lost. The same holds while a later phase waits (pods
starting, transfers running, a sidecar call failed): the survivors are probed at most every
PROBE_EVERY_S, so a node lost during the recovery makes it plan again within a second or
two, not when the poller's confirmation or the node controller says so.
"""

from __future__ import annotations

import logging
import math
import re
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from datetime import UTC, datetime

from gemini.domain.recovery import FailureKind, RecoveryPlan, plan_recovery
from gemini_operator.calls.sidecars import SidecarError, refusing, worker_ports
from gemini_operator.calls.worker_calls import WorkerCalls, inventory_copies
from gemini_operator.cluster.cache import ClusterCache, Snapshot
from gemini_operator.cluster.kube import KubeClient
from gemini_operator.core import render
from gemini_operator.core.actions import Recover
from gemini_operator.core.apitime import api_time
from gemini_operator.core.failures import describe
from gemini_operator.core.node_affinity import avoiding_nodes, preferring_nodes
from gemini_operator.core.observed import PodView, pod_view
from gemini_operator.core.outcome import Outcome, RecoveryWait, S3Unreadable, Unrecoverable
from gemini_operator.core.records import MODE_FRESH, PlanRecord, RecoveryPhase, RecoveryRecord
from gemini_operator.core.silence import PRESUME_S, suspects
from gemini_operator.core.spares import spare_nodes
from gemini_operator.core.spec import JobSpec
from gemini_operator.core.status import JobStatus
from gemini_operator.core.status_changes import RecoveryAt, RecoveryDropped, StatusWriter
from gemini_operator.core.types import JobView, ReconcileConfig
from gemini_operator.steps.restore import PhaseExecutor

log = logging.getLogger(__name__)
WAIT_SECONDS = 0.25
WAIT_LOG_REPEAT_S = 10.0
PROBE_TIMEOUT_SECONDS = 1.0  # a TCP connect to a silent sidecar's and launcher's ports
PROBE_EVERY_S = 1.0  # survivors probed at most this often while a recovery waits


class RecoveryExecutor(PhaseExecutor):
    """Carries a recovery from the failure to the restarted epoch, phase by phase."""

    def __init__(
        self, kube: KubeClient, config: ReconcileConfig, calls: WorkerCalls,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
        cache: ClusterCache | None = None,
    ) -> None:
        super().__init__(kube, config, calls, clock)
        self.cache = cache  # where lost nodes are presumed (silence.py); None: never

    def recover(self, job: JobView, snap: Snapshot, action: Recover, status: JobStatus,
                writer: StatusWriter) -> Outcome:
        record = status.recovery
        launched = status.launch.epoch if status.launch is not None else 0
        if record is None or record.epoch <= launched:
            record = self._begin(job, action, launched, writer)
        elif newly_lost(action, record):
            # A node went NotReady after the recovery was planned (a peer's crash is often
            # seen first): plan again with the lost ranks, keeping the epoch and start time.
            record = self._begin(job, action, launched, writer, record)
        try:
            return self._run_phases(job, snap, action, status, record, writer)
        except SidecarError as err:  # a sidecar restarting or cut off: try again shortly
            self._say_wait(job, f"waits for a sidecar: {err}")
            self._look_for_lost_survivors(job, status, record)
        except RecoveryWait as wait:
            self._say_wait(job, f"waits: {wait}")
            self._look_for_lost_survivors(job, status, record)
        except Unrecoverable as err:
            writer.set(RecoveryDropped())
            return Outcome(unrecoverable=(record.cause or "a failure", str(err)))
        return Outcome(requeue_after=WAIT_SECONDS)

    def _say_wait(self, job: JobView, what: str) -> None:
        level = _WAITS.level((job.namespace, job.name), what)
        log.log(level, "recovery of %s/%s %s", job.namespace, job.name, what)

    def _run_phases(self, job: JobView, snap: Snapshot, action: Recover, status: JobStatus,
                    record: RecoveryRecord, writer: StatusWriter) -> Outcome:
        spec = action.spec
        if record.phase is RecoveryPhase.PLANNING:
            plan = self._plan(job, spec, status, record)
            record = self._step(record, RecoveryPhase.REPLACING, writer, plan)
        if record.phase is RecoveryPhase.REPLACING:
            self._replace(job, snap, action, status, record)
            if status.launch is None:  # never started: the start protocol takes it from here
                pods = self.calls.listed(job, status.restart_attempt)
                return self.restorer.finish(job, status, record, pods, writer)
            record = self._step(record, RecoveryPhase.FETCHING, writer)
        if record.phase is RecoveryPhase.FETCHING:
            self.restorer.fetch(job, spec, status, record)
            record = self._step(record, RecoveryPhase.RESTARTING, writer)
        return self.restorer.restart(job, spec, status, record, writer)

    def _begin(self, job: JobView, action: Recover, launched_epoch: int, writer: StatusWriter,
               previous: RecoveryRecord | None = None) -> RecoveryRecord:
        now = self._clock()
        failed = sorted({f.rank for f in action.failures}
                        | set(previous.failed_ranks if previous else ()))
        lost = sorted({f.rank for f in action.failures if f.kind is FailureKind.HARDWARE}
                      | set(previous.lost_ranks if previous else ()))
        kind = action.kind.value if previous is None or lost else previous.kind
        record = RecoveryRecord(
            epoch=previous.epoch if previous else launched_epoch + 1,
            phase=RecoveryPhase.PLANNING,
            kind=FailureKind.HARDWARE.value if lost else kind,
            cause=describe(action.failures) or (previous.cause if previous else "a failure"),
            failed_ranks=tuple(failed),
            detected_at=previous.detected_at if previous else api_time(now),
            started_at=previous.started_at if previous else api_time(now),
            started_unix=previous.started_unix if previous else now.timestamp(),
            # cumulative seconds at the end of each phase; a re-plan times them afresh
            marks=previous.superseded_marks(now.timestamp()) if previous else {},
            lost_ranks=tuple(lost),
        )
        writer.ahead(RecoveryAt(record))  # recorded before anything is done
        return record

    def _step(self, record: RecoveryRecord, phase: RecoveryPhase, writer: StatusWriter,
              plan: PlanRecord | None = None) -> RecoveryRecord:
        new = record.at(phase, self._clock().timestamp(), plan)
        writer.ahead(RecoveryAt(new))
        return new

    def _plan(self, job: JobView, spec: JobSpec, status: JobStatus,
              record: RecoveryRecord) -> PlanRecord:
        lost = set(record.lost_ranks)
        if status.placement is None or status.launch is None:
            return _fresh(lost, "training had not started")
        placement = status.placement.layout
        pods = self.calls.listed(job, status.restart_attempt)
        live = {r: p for r, p in pods.items() if r not in lost and p.ip and not p.deleting}
        # A sidecar that does not answer holds nothing we can count on (its node may be cut
        # off): plan without its copies rather than wait for it.
        inventories, silent = self.calls.inventories(live, self.calls.token(job))
        if silent:
            log.warning("planning without %d silent sidecars: %s", len(silent), silent[:3])
            if nodes := self._presume_lost_nodes(job, live, inventories):
                raise RecoveryWait(f"node(s) {', '.join(nodes)} presumed lost: planning again")
        copies = inventory_copies(inventories)
        try:
            s3_steps = list(self.calls.committed_steps(job, spec.persistence))
        except S3Unreadable as err:  # memory may still suffice: plan with it alone
            log.warning("planning %s/%s without S3: %s", job.namespace, job.name, err)
            s3_steps = []
        newest = max((c.version for c in copies), default=None)
        if not copies and not s3_steps and status.checkpoint.in_memory_step is None:
            # Nothing was ever checkpointed: training starts over (deterministic, same steps).
            return _fresh(lost, "no checkpoint was taken yet")
        plan = plan_recovery(placement.replicas, placement, record.failed_ranks, lost,
                             copies, s3_steps)
        if not plan.recoverable:
            raise Unrecoverable(plan.reason)
        return PlanRecord.from_plan(plan, newest)

    def _presume_lost_nodes(self, job: JobView, live: Mapping[int, PodView],
                            answering: Iterable[int]) -> list[str]:
        """Presume lost the nodes of pods that answered before, still show running, are not
        in `answering`, and now refuse both connections; those nodes (the next reconcile
        sees their ranks lost and plans again)."""
        if self.cache is None:
            return []
        probe = suspects(live, answering, self.cache.has_answered)
        down = refusing(worker_ports(probe, self.config.render), PROBE_TIMEOUT_SECONDS)
        nodes = sorted({probe[r].node_name for r in down if probe[r].node_name})
        for node in nodes:
            self.cache.presume_lost(node, self._clock(), PRESUME_S)
        if nodes:
            log.warning("recovery of %s/%s: node(s) %s presumed lost: their pods refuse "
                        "connections while the API shows them running", job.namespace,
                        job.name, ", ".join(nodes))
        return nodes

    def _look_for_lost_survivors(self, job: JobView, status: JobStatus,
                                 record: RecoveryRecord) -> None:
        """While the recovery waits, probe the pods it keeps (at most every PROBE_EVERY_S):
        a survivor's node lost since the plan is presumed lost now, and the next reconcile
        plans again with it, instead of waiting for a transfer from it to fail for good or
        for the poller's confirmation (silence.py)."""
        if self.cache is None or record.phase is RecoveryPhase.PLANNING:
            return  # Planning probes the silent ones itself
        if not _PROBES.due((job.namespace, job.name)):
            return
        replaced = set(record.plan.replace_ranks) if record.plan else set()
        pods = self.calls.listed(job, status.restart_attempt)
        kept = {r: p for r, p in pods.items()
                if r not in replaced and r not in record.lost_ranks and p.ip and not p.deleting}
        self._presume_lost_nodes(job, kept, ())

    def _replace(self, job: JobView, snap: Snapshot, action: Recover, status: JobStatus,
                 record: RecoveryRecord) -> None:
        replace = list(record.plan.replace_ranks) if record.plan else []
        if not replace:
            return
        # Read from the API, not the watch cache: a missed DELETED event must not leave the
        # recovery waiting for a pod that is long gone.
        views = (pod_view(o) for o in self.kube.list_worker_pods(job.namespace, job.name,
                                                                 replace))
        pods = {v.rank: v for v in views if v is not None and v.owner_uid == job.uid}
        launch_uids = status.launch.pod_uids if status.launch is not None else {}
        old_uids = {launch_uids.get(r) for r in replace}
        waiting = []
        down = sorted(n for n, node in snap.nodes.items() if not node.ready)
        for rank in replace:
            pod = pods.get(rank)
            if pod is not None and pod.uid not in old_uids and pod.node_name in down:
                # The scheduler placed the replacement before the node was marked lost.
                self.kube.delete_pod(job.namespace, pod.name, grace_seconds=0)
                waiting.append(f"rank {rank}: replacement landed on lost node {pod.node_name}")
            elif pod is not None and pod.uid in old_uids:
                # The lost pod: gone for good (its node may never answer), free the name now.
                self.kube.delete_pod(job.namespace, pod.name, grace_seconds=0)
                waiting.append(f"rank {rank}: the lost pod is being removed")
            elif pod is None:
                manifest = render.worker_pod(job.ref, action.spec, rank, status.restart_attempt,
                                             self.config.render)
                # Spares first: off lost nodes, towards a node a placeholder holds (when none
                # is free, the scheduler preempts a placeholder: it has the lowest priority).
                self.kube.create(preferring_nodes(avoiding_nodes(manifest, down),
                                                  spare_nodes(snap.spares, snap.nodes)))
                waiting.append(f"rank {rank}: replacement created")
            elif pod.phase != "Running" or not pod.ip:
                waiting.append(f"rank {rank}: replacement is {pod.phase}")
        if waiting:
            raise RecoveryWait("; ".join(waiting))


class WaitLog:
    """A recovery is asked again every WAIT_SECONDS while it waits: what it waits for is
    logged at INFO when that changes (figures aside: a transfer's progress is not news) or
    every WAIT_LOG_REPEAT_S, at DEBUG in between. Keyed by job; safe across threads."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._last: dict[tuple[str, str], tuple[str, float]] = {}

    def level(self, key: tuple[str, str], message: str) -> int:
        gist, now = _FIGURES.sub("#", message), self._clock()
        with self._lock:
            said, when = self._last.get(key, ("", -math.inf))
            if gist == said and now - when < WAIT_LOG_REPEAT_S:
                return logging.DEBUG
            if len(self._last) > 4096:  # jobs come and go
                self._last.clear()
            self._last[key] = (gist, now)
        return logging.INFO


_FIGURES = re.compile(r"\d+(\.\d+)?")
_WAITS = WaitLog()


class Throttle:
    """True for a key at most once every `seconds`; keyed by job, safe across threads."""

    def __init__(self, seconds: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._seconds, self._clock = seconds, clock
        self._lock = threading.Lock()
        self._last: dict[tuple[str, str], float] = {}

    def due(self, key: tuple[str, str]) -> bool:
        now = self._clock()
        with self._lock:
            if now - self._last.get(key, -math.inf) < self._seconds:
                return False
            if len(self._last) > 4096:  # jobs come and go
                self._last.clear()
            self._last[key] = now
            return True


_PROBES = Throttle(PROBE_EVERY_S)


def newly_lost(action: Recover, record: RecoveryRecord) -> bool:
    """Whether ranks are lost now that the recorded plan did not replace."""
    lost = {f.rank for f in action.failures if f.kind is FailureKind.HARDWARE}
    return bool(lost - set(record.lost_ranks))


def _fresh(lost: set[int], reason: str) -> PlanRecord:
    """Nothing to restore: training starts over once the lost ranks are replaced."""
    return PlanRecord.from_plan(RecoveryPlan(None, MODE_FRESH, {}, tuple(sorted(lost)), {},
                                             reason), None)
