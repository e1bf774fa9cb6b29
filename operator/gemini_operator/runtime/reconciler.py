"""Executes decisions: observe (cache + a few reads), decide (pure `decide.decide`), act,
record. `workqueue.WorkQueue` calls `Reconciler.reconcile(key)`; `wiring.build_reconciler`
builds it with its collaborators.

`Reconciler.reconcile(key)` makes a status writer for the job (status_writer.py), executes the
decision's actions through an action table (one handler per action type; the steps set status
through the writer), then writes what changed in the status, then sends the events.

When it writes. Normally once, after the actions, and only if something changed. Recovery
writes ahead: a decision that starts a recovery (or fails the job) is written before any
action, so the failure shows within a second even when planning waits on sidecars; and each
recovery or resume phase is written to status.recovery before it acts (recovery.py, start.py:
the writer's `ahead`), so a restarted operator continues from the recorded phase; the final
write keeps it. Events are sent only after the last write of the reconcile. A failure before a
write leaves the status as it was, so the next attempt decides again from the same record.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from typing import Any

from gemini_operator.calls.poller import CheckpointPoller
from gemini_operator.cluster.cache import ClusterCache, JobKey, Snapshot
from gemini_operator.cluster.kube import Invalid, KubeClient, NotOwned
from gemini_operator.core import naming
from gemini_operator.core.actions import (
    CreateNetworkPolicy,
    CreatePods,
    CreateSecret,
    CreateService,
    CreateWorkload,
    Decision,
    DeleteJob,
    DeletePods,
    DeleteWorkload,
    DeliverPlacement,
    PatchWorkload,
    Recover,
    SaveBeforeSuspend,
    StartTraining,
)
from gemini_operator.core.conditions import (
    FAILURE_POLICY_FAIL_JOB,
    MAX_RESTARTS_EXCEEDED,
    RECOVERY_NEEDED,
    Condition,
    state_of,
)
from gemini_operator.core.decide import decide
from gemini_operator.core.events import Event
from gemini_operator.core.observed import PodView
from gemini_operator.core.outcome import Outcome
from gemini_operator.core.queueing import queue_name, was_queued
from gemini_operator.core.records import RecoveryRecord
from gemini_operator.core.spares import HoldSpares
from gemini_operator.core.spec import persist_interval_seconds
from gemini_operator.core.status import CheckpointStatus
from gemini_operator.core.types import JobView, Observed, ReconcileConfig
from gemini_operator.runtime.children import JobChildren
from gemini_operator.runtime.deliveries import PlacementDeliveries
from gemini_operator.runtime.metrics import JobReport, OperatorMetrics
from gemini_operator.runtime.status_writer import JobStatusWriter, StatusSender
from gemini_operator.steps.recovery import RecoveryExecutor, newly_lost
from gemini_operator.steps.start import TrainingStarter
from gemini_operator.steps.suspend import SuspendSaver
from gemini_operator.steps.workloads import Workloads

log = logging.getLogger(__name__)
EXPECTATION_SECONDS = 60.0  # how long a created pod may take to show up in the watch
# While a job's workers are not all ready, its pods are also re-listed this often: on a loaded
# API server the watch can lose events (it closes watchers it finds slow), and a job must not
# wait minutes for readiness it missed (seen at 1000 ranks).
RELIST_SECONDS = 5.0
PARALLEL_WRITES = 16

Handler = Callable[[JobStatusWriter, JobView, Snapshot, Any], None]


class Reconciler:
    def __init__(
        self, kube: KubeClient, cache: ClusterCache, config: ReconcileConfig, *,
        poller: CheckpointPoller, status: StatusSender, children: JobChildren,
        recovery: RecoveryExecutor, starter: TrainingStarter, suspend_saver: SuspendSaver,
        workloads: Workloads, deliveries: PlacementDeliveries, metrics: OperatorMetrics,
        clock: Callable[[], datetime],
    ) -> None:
        self.kube, self.cache, self.config = kube, cache, config
        self.poller, self.status, self.metrics, self._clock = poller, status, metrics, clock
        self.children, self.workloads, self.deliveries = children, workloads, deliveries
        self.recovery, self.starter, self.suspend_saver = recovery, starter, suspend_saver
        self._expected: dict[JobKey, dict[int, float]] = {}  # rank -> monotonic deadline
        # A worker pod the API server refused as invalid, by job: (uid, generation, message).
        self._refused: dict[JobKey, tuple[str, int, str]] = {}
        self._listed: dict[JobKey, float] = {}  # monotonic time of the last re-list of pods
        self._handlers: dict[type, Handler] = {
            CreateSecret: children.create_secret,
            CreateService: children.create_service,
            CreateNetworkPolicy: children.create_network_policy,
            CreatePods: self._create_pods,
            DeletePods: self._delete_pods,
            DeliverPlacement: deliveries.deliver,
            Recover: self._recover,
            StartTraining: self._start_training,
            SaveBeforeSuspend: self._save_before_suspend,
            HoldSpares: self._hold_spares,
            DeleteJob: self._delete_job,
            CreateWorkload: self._create_workload,
            PatchWorkload: self._patch_workload,
            DeleteWorkload: self._delete_workload,
        }

    def reconcile(self, key: JobKey) -> float | None:
        """One reconcile of job `key`; returns seconds until a time-based re-check, if any."""
        snap = self.cache.snapshot(key)
        if snap is None or (snap.job.get("metadata") or {}).get("deletionTimestamp"):
            self._forget(key)
            return None
        other = naming.managed_elsewhere(snap.job.get("spec"))
        if other is not None:  # MultiKueue's, say: that controller writes its status
            log.debug("%s/%s is managed by %s: left alone", *key, other)
            return None
        started = time.monotonic()
        self.metrics.reconciles.inc()
        job = JobView.from_object(snap.job)
        unsettled = _unsettled(job)
        if unsettled:
            snap = self._relist(key, snap)
        snap, decision = self._decide(key, job, snap)
        writer = JobStatusWriter(self.status, job, decision.status, self._clock)
        try:
            if _new_failure(decision):
                # On record before it is acted on: planning may wait seconds on sidecars, and
                # the failure must show (Recovering, restarts) within a second of the API
                # event.
                writer.write()
            self._act(writer, job, snap, decision)
            final = writer.write()
        except NotOwned as err:  # the rank-detail ConfigMap's name is taken: fail the job
            log.warning("%s/%s: %s", job.namespace, job.name, err)
            self.children.record_conflict(job, str(err))
            return 0.0
        self._send_events(job, [*decision.events, *final.events,
                                *(e for o in writer.outcomes for e in o.events)])
        self.metrics.reconciled(key, _report(job, final.conditions, final.document,
                                             decision.status.checkpoint),
                                time.monotonic() - started)
        return _requeue_after(decision, writer.outcomes, unsettled)

    def _forget(self, key: JobKey) -> None:
        """The job is gone (or going): nothing of it is kept."""
        self._expected.pop(key, None)
        self._refused.pop(key, None)
        self.deliveries.forget(key)
        self._listed.pop(key, None)
        self.status.forget(key)
        self.metrics.forget(key)

    def _relist(self, key: JobKey, snap: Snapshot) -> Snapshot:
        """The job's pods listed again, at most every RELIST_SECONDS."""
        if time.monotonic() - self._listed.get(key, 0.0) < RELIST_SECONDS:
            return snap
        self._listed[key] = time.monotonic()
        self.cache.replace_pods(key, self.kube.list_worker_pods(*key))
        return self.cache.snapshot(key) or snap

    def _decide(self, key: JobKey, job: JobView, snap: Snapshot) -> tuple[Snapshot, Decision]:
        decision = decide(self._observe(key, job, snap), self.config)
        if _new_failure(decision) or _replans(decision):
            # Confirm with the API before acting: right after start-up the watches may not
            # have listed every pod and node yet, and a missing pod must not count as lost.
            snap = self._refresh(key, snap, _failed_ranks(decision))
            decision = decide(self._observe(key, job, snap), self.config)
        return snap, decision

    def _act(self, writer: JobStatusWriter, job: JobView, snap: Snapshot,
             decision: Decision) -> None:
        detected = any(e.reason == RECOVERY_NEEDED.reason for e in decision.events)
        for action in decision.actions:
            if isinstance(action, Recover) and detected:
                self.metrics.recovery_detected(action.kind.value, _failures(decision),
                                               _own(job, snap), snap.nodes, self._clock(),
                                               self._parked_at(job))
            self._handlers[type(action)](writer, job, snap, action)
        for outcome in writer.outcomes:
            if outcome.finished is not None:
                self.metrics.observe_recovery(outcome.finished)

    def _parked_at(self, job: JobView) -> Mapping[int, datetime]:
        found = self.poller.findings((job.namespace, job.name))
        return found.parked_at if found else {}

    def _observe(self, key: JobKey, job: JobView, snap: Snapshot) -> Observed:
        own = _own(job, snap)
        found = self.poller.findings(key)
        return Observed(
            job=job, pods=own, nodes=snap.nodes,
            checkpoint=found.checkpoint if found else None,
            progress=found.progress if found else None,
            parked=found.parked if found else {},
            process_exits=found.exits if found else {},
            foreign_ranks=frozenset(snap.pods) - frozenset(own),
            has_service=self.children.has_service(job),
            has_secret=self.children.has_secret(job),
            has_network_policy=self.config.render.network_policy
            and self.children.has_network_policy(job),
            child_conflict=self.children.conflict(job),
            now=self._clock(), pending_creates=self._pending(key, snap),
            spares={i: s for i, s in snap.spares.items() if s.owner_uid == job.uid},
            pod_refused=self._pod_refusal(key, job),
            workload=self.workloads.observe(job) if queue_name(job.labels)
            or snap.has_workload or was_queued(job.status) else None,
        )

    def _pod_refusal(self, key: JobKey, job: JobView) -> str | None:
        """The API server's refusal of this job's worker pods, for this very spec."""
        refused = self._refused.get(key)
        if refused is None or refused[:2] != (job.uid, job.generation):
            return None
        return refused[2]

    def _refresh(self, key: JobKey, snap: Snapshot, ranks: set[int] | None = None) -> Snapshot:
        """The pods (of `ranks` only, when given) and the not-Ready nodes read again."""
        if ranks:
            self.cache.replace_ranks(key, ranks, self.kube.list_worker_pods(*key, ranks=ranks))
        else:
            self.cache.replace_pods(key, self.kube.list_worker_pods(*key))
        fresh = self.cache.snapshot(key) or snap
        for name in {p.node_name for p in fresh.pods.values() if p.node_name}:
            node = fresh.nodes.get(name)
            if node is None or not node.ready:
                obj = self.kube.get_node(name)
                if obj is not None:
                    self.cache.update_node(obj, deleted=False)
        return self.cache.snapshot(key) or fresh

    def _pending(self, key: JobKey, snap: Snapshot) -> frozenset[int]:
        expected = self._expected.get(key, {})
        now = time.monotonic()
        for rank in [r for r, deadline in expected.items() if r in snap.pods or deadline < now]:
            del expected[rank]
        return frozenset(expected)

    # --- the action table ---------------------------------------------------------------

    def _create_pods(self, writer: JobStatusWriter, job: JobView, snap: Snapshot,
                     action: CreatePods) -> None:
        expected = self._expected.setdefault((job.namespace, job.name), {})
        deadline = time.monotonic() + EXPECTATION_SECONDS
        ranks = [int(m["metadata"]["labels"][naming.LABEL_RANK]) for m in action.manifests]
        for rank in ranks:
            expected[rank] = deadline
        try:
            created = _parallel(self.kube.create, action.manifests)
        except Invalid as err:  # the spec's pod cannot exist: say so in the job, do not retry
            log.warning("%s/%s: %s", job.namespace, job.name, err)
            self._refused[(job.namespace, job.name)] = (job.uid, job.generation, str(err))
            writer.outcomes.append(Outcome(requeue_after=0.0))
            return
        for rank, fresh in zip(ranks, created, strict=True):
            if not fresh:  # the name is taken: wait for that pod, do not expect ours
                expected.pop(rank, None)

    def _delete_pods(self, writer: JobStatusWriter, job: JobView, snap: Snapshot,
                     action: DeletePods) -> None:
        log.info("deleting %d pods of %s/%s: %s", len(action.names), job.namespace, job.name,
                 action.reason)
        _parallel(lambda name: self.kube.delete_pod(job.namespace, name), action.names)

    def _recover(self, writer: JobStatusWriter, job: JobView, snap: Snapshot,
                 action: Recover) -> None:
        outcome = self.recovery.recover(job, snap, action, writer.decided, writer)
        writer.outcomes.append(outcome)

    def _start_training(self, writer: JobStatusWriter, job: JobView, snap: Snapshot,
                        action: StartTraining) -> None:
        outcome = self.starter.start_training(job, snap, action, writer.decided, writer)
        writer.outcomes.append(outcome)

    def _save_before_suspend(self, writer: JobStatusWriter, job: JobView, snap: Snapshot,
                             action: SaveBeforeSuspend) -> None:
        outcome = self.suspend_saver.save_before_suspend(job, snap, action, writer.decided,
                                                         writer)
        writer.outcomes.append(outcome)
        # The poller's findings predate this commit: drop them, or the next reconcile would
        # put the older persistedStep back (it starts again from the status on resume).
        self.poller.forget((job.namespace, job.name))

    def _hold_spares(self, writer: JobStatusWriter, job: JobView, snap: Snapshot,
                     action: HoldSpares) -> None:
        """Placeholders: made again by name when gone (a create of an existing one is a no-op),
        those on lost nodes removed at once (grace 0), unwanted ones gracefully."""
        _parallel(self.kube.create, action.create)
        _parallel(lambda name: self.kube.delete_pod(job.namespace, name, grace_seconds=0),
                  action.force_delete)
        _parallel(lambda name: self.kube.delete_pod(job.namespace, name), action.delete)

    def _delete_job(self, writer: JobStatusWriter, job: JobView, snap: Snapshot,
                    action: DeleteJob) -> None:
        self.kube.delete_job(job.namespace, job.name)

    def _create_workload(self, writer: JobStatusWriter, job: JobView, snap: Snapshot,
                         action: CreateWorkload) -> None:
        writer.outcomes.append(self.workloads.create(job, action))

    def _patch_workload(self, writer: JobStatusWriter, job: JobView, snap: Snapshot,
                        action: PatchWorkload) -> None:
        writer.outcomes.append(self.workloads.patch(job, action))

    def _delete_workload(self, writer: JobStatusWriter, job: JobView, snap: Snapshot,
                         action: DeleteWorkload) -> None:
        writer.outcomes.append(self.workloads.delete(job, action))

    def _send_events(self, job: JobView, events: Iterable[Event]) -> None:
        ref = {"name": job.name, "namespace": job.namespace, "uid": job.uid}
        for event in events:
            try:
                self.kube.create_event(ref, event.reason, event.message, event.warning,
                                       self._clock())
            except Exception as err:
                log.warning("could not record event %s: %s", event.reason, err)


def _own(job: JobView, snap: Snapshot) -> dict[int, PodView]:
    """The job's pods. A deleted job's pods may linger (the garbage collector takes its time)
    while a new job of the same name starts: only pods controlled by this very job count."""
    return {r: p for r, p in snap.pods.items() if p.owner_uid == job.uid}


def _requeue_after(decision: Decision, outcomes: Sequence[Outcome], unsettled: bool
                   ) -> float | None:
    """The soonest re-check anything asked for."""
    waits = [o.requeue_after for o in outcomes if o.requeue_after is not None]
    if decision.requeue_after is not None:
        waits.append(decision.requeue_after)
    if unsettled:
        waits.append(RELIST_SECONDS)
    return min(waits) if waits else None


def _replans(decision: Decision) -> bool:
    """Whether this decision makes the recovery under way plan again because ranks look lost
    that its plan did not replace; an operator that just started may not have listed every
    pod and node yet, and a present pod must not count as lost (nor a healthy rank be planned
    without)."""
    record = decision.status.recovery
    return record is not None and any(isinstance(a, Recover) and newly_lost(a, record)
                                      for a in decision.actions)


def _failed_ranks(decision: Decision) -> set[int] | None:
    """The ranks a recovery decision is about (None: not a recovery; re-read every pod)."""
    ranks = {rank for rank, _ in _failures(decision)}
    return ranks or None


def _failures(decision: Decision) -> list[tuple[int, str]]:
    """(rank, cause) of every failure a recovery decision is about."""
    return [(f.rank, f.reason.value) for a in decision.actions if isinstance(a, Recover)
            for f in a.failures]


def _report(job: JobView, conditions: Sequence[Condition], written: Mapping[str, Any],
            checkpoint: CheckpointStatus) -> JobReport:
    """What the per-job metrics show of a reconcile that wrote status `written`."""
    recovery = written.get("recovery")
    started = RecoveryRecord.started_timestamp(recovery) if recovery else None
    return JobReport(state_of(conditions), checkpoint, started,
                     persist_interval_seconds(job.spec))


def _unsettled(job: JobView) -> bool:
    """Whether the job is starting: not every worker ready yet, and nothing else going on (a
    recovery reads the pods it needs itself; finished and suspended jobs wait for nothing)."""
    status = job.status or {}
    if status.get("state") not in (None, "Created", "Running"):
        return False
    ready = int((status.get("workers") or {}).get("ready", 0))
    return "numNodes" in job.spec and ready < int(job.spec["numNodes"])


def _new_failure(decision: Decision) -> bool:
    """Whether this decision starts a recovery or fails the job (both need confirmation)."""
    return any(e.reason in _FAILING for e in decision.events)


_FAILING = frozenset(
    r.reason for r in (RECOVERY_NEEDED, MAX_RESTARTS_EXCEEDED, FAILURE_POLICY_FAIL_JOB)
)


def _parallel(fn: Callable[[Any], Any], items: Any) -> list[Any]:
    """`fn` over `items` with a few requests in flight; results in order; the first failure
    is raised (after the others finished)."""
    items = list(items)
    if len(items) <= 1:
        return [fn(item) for item in items]
    with ThreadPoolExecutor(max_workers=min(PARALLEL_WRITES, len(items))) as pool:
        return list(pool.map(fn, items))
