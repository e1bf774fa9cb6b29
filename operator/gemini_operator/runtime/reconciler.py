# Over 500 lines: its action table and status flow stay whole until issue 40 item 6 reshapes them.
"""Executes decisions: observe (cache + a few reads), decide (pure `decide.decide`), act,
record. `workqueue.WorkQueue` calls `Reconciler.reconcile(key)`.

`Reconciler.reconcile(key)` makes a status writer for the job (status_writer.py), executes the
decision's actions through an action table (one handler per action type; the steps set status
through the writer), then writes what changed in the status, then sends the events.

When it writes. Normally once, after the actions, and only if something changed. Recovery
writes ahead: a decision that starts a recovery (or fails the job) is written before any
action, so the failure shows within a second even when planning waits on sidecars; and each
recovery or resume phase is written to status.recovery before it acts (recovery.py,
start.py: `ahead`), so a restarted operator continues from the recorded phase; the final
write keeps it. Events are sent only
after the last write of the reconcile. A failure before a write leaves the status as it was,
so the next attempt decides again from the same record.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from typing import Any

from gemini_operator.calls import placement_delivery
from gemini_operator.calls.background import BackgroundCalls, Finished, Running
from gemini_operator.calls.poller import CheckpointPoller
from gemini_operator.calls.sidecars import DELIVERY_TIMEOUT_SECONDS, DeliveryError
from gemini_operator.calls.tokens import JobTokens
from gemini_operator.cluster.cache import ClusterCache, JobKey, Snapshot
from gemini_operator.cluster.kube import Invalid, KubeClient
from gemini_operator.core import children, naming
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
from gemini_operator.core.apitime import api_time, parse_api_time
from gemini_operator.core.conditions import (
    FAILURE_POLICY_FAIL_JOB,
    MAX_RESTARTS_EXCEEDED,
    PLACEMENT_DELIVERED,
    RECOVERY_NEEDED,
    SIDECARS_UNREACHABLE,
    Condition,
    ConditionType,
    find,
    state_of,
)
from gemini_operator.core.decide import decide
from gemini_operator.core.events import Event
from gemini_operator.core.observed import detection_lags
from gemini_operator.core.outcome import Outcome
from gemini_operator.core.queueing import queue_name, was_queued
from gemini_operator.core.spares import HoldSpares
from gemini_operator.core.status import JobStatus
from gemini_operator.core.types import JobView, Observed, ReconcileConfig
from gemini_operator.runtime.metrics import OperatorMetrics
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
# Placement delivery to sidecars that did not take it is retried after 0.5, 1, 2, ... 30 s.
DELIVERY_RETRY_SECONDS, DELIVERY_RETRY_MAX_SECONDS = 0.5, 30.0


Handler = Callable[[JobStatusWriter, JobView, Snapshot, Any], None]


class Reconciler:
    """Built with its collaborators by `wiring.build_reconciler`."""

    def __init__(
        self, kube: KubeClient, cache: ClusterCache, config: ReconcileConfig, *,
        tokens: JobTokens, poller: CheckpointPoller, status: StatusSender,
        recovery: RecoveryExecutor, starter: TrainingStarter, suspend_saver: SuspendSaver,
        workloads: Workloads, sidecar_calls: BackgroundCalls, metrics: OperatorMetrics,
        clock: Callable[[], datetime],
    ) -> None:
        self.kube, self.cache, self.config, self.tokens = kube, cache, config, tokens
        self.poller, self.status, self.metrics, self._clock = poller, status, metrics, clock
        self.recovery, self.starter, self.suspend_saver = recovery, starter, suspend_saver
        self.workloads = workloads
        self.sidecar_calls = sidecar_calls  # its end wakes the job
        self._expected: dict[JobKey, dict[int, float]] = {}  # rank -> monotonic deadline
        # A worker pod the API server refused as invalid, by job: (uid, generation, message).
        self._refused: dict[JobKey, tuple[str, int, str]] = {}
        self._children: set[tuple[str, str]] = set()  # (job uid, kind) known to exist
        self._delivery: dict[JobKey, tuple[int, float]] = {}  # failures, monotonic next try
        self._listed: dict[JobKey, float] = {}  # monotonic time of the last re-list of pods
        self._handlers: dict[type, Handler] = {
            CreateSecret: self._create_secret,
            CreateService: self._create_service,
            CreateNetworkPolicy: self._create_network_policy,
            CreatePods: self._create_pods,
            DeletePods: self._delete_pods,
            DeliverPlacement: self._deliver_placement,
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
            self._expected.pop(key, None)
            self._refused.pop(key, None)
            self._delivery.pop(key, None)
            self.sidecar_calls.forget(key)
            self._listed.pop(key, None)
            self.status.store.forget(*key)
            self.metrics.job_state(key, None)
            self.metrics.replica_coverage(key, None)
            self.metrics.checkpoint_pace(key, None)
            return None
        started = time.monotonic()
        self.metrics.reconciles.inc()
        job = JobView.from_object(snap.job)
        unsettled = _unsettled(job)
        if unsettled and time.monotonic() - self._listed.get(key, 0.0) >= RELIST_SECONDS:
            self._listed[key] = time.monotonic()
            self.cache.replace_pods(key, self.kube.list_worker_pods(*key))
            snap = self.cache.snapshot(key) or snap
        decision = decide(self._observe(key, job, snap), self.config)
        if _new_failure(decision) or _replans(decision):
            # Confirm with the API before acting: right after start-up the watches may not
            # have listed every pod and node yet, and a missing pod must not count as lost.
            snap = self._refresh(key, snap, _failed_ranks(decision))
            decision = decide(self._observe(key, job, snap), self.config)
        writer = JobStatusWriter(self.status, job, decision.status, self._clock)
        if _new_failure(decision):
            # On record before it is acted on: planning may wait seconds on sidecars, and
            # the failure must show (Recovering, restarts) within a second of the API event.
            writer.write()
        for action in decision.actions:
            if isinstance(action, Recover) and any(
                e.reason == RECOVERY_NEEDED.reason for e in decision.events
            ):
                self.metrics.recoveries.labels(kind=action.kind.value).inc()
                self._record_detection(job, snap, decision)
            self._handlers[type(action)](writer, job, snap, action)
        for outcome in writer.outcomes:
            if outcome.finished is not None:
                self.metrics.observe_recovery(outcome.finished)
        final = writer.write()
        self._send_events(job, [*decision.events, *final.events,
                                *(e for o in writer.outcomes for e in o.events)])
        self.metrics.job_state(key, state_of(final.conditions))
        self.metrics.replica_coverage(key, decision.status.checkpoint.replica_coverage)
        self.metrics.checkpoint_pace(key, decision.status.checkpoint)
        persisted = parse_api_time(decision.status.checkpoint.persisted_time)
        if persisted is not None:
            age = (self._clock() - persisted).total_seconds()
            self.metrics.persist_age.labels(job=f"{job.namespace}/{job.name}").set(age)
        self.metrics.reconcile_seconds.observe(time.monotonic() - started)
        waits = [o.requeue_after for o in writer.outcomes if o.requeue_after is not None]
        if decision.requeue_after is not None:
            waits.append(decision.requeue_after)
        if unsettled:
            waits.append(RELIST_SECONDS)
        return min(waits) if waits else None

    def _record_detection(self, job: JobView, snap: Snapshot, decision: Decision) -> None:
        self.metrics.detections.inc()
        own = {r: p for r, p in snap.pods.items() if p.owner_uid == job.uid}
        failures = [(f.rank, f.reason.value) for a in decision.actions if isinstance(a, Recover)
                    for f in a.failures]
        for cause, lag in detection_lags(failures, own, snap.nodes, self._clock()).items():
            self.metrics.detection_seconds.labels(cause=cause).observe(lag)

    def _observe(self, key: JobKey, job: JobView, snap: Snapshot) -> Observed:
        # A deleted job's pods may linger (the garbage collector takes its time) while a new
        # job of the same name starts: only pods controlled by this very job are its own.
        own = {r: p for r, p in snap.pods.items() if p.owner_uid == job.uid}
        found = self.poller.findings(key)
        return Observed(
            job=job, pods=own, nodes=snap.nodes,
            checkpoint=found.checkpoint if found else None,
            progress=found.progress if found else None,
            parked=found.parked if found else {},
            process_exits=found.exits if found else {},
            foreign_ranks=frozenset(snap.pods) - frozenset(own),
            has_service=self._exists(job, "Service", naming.service_name(job.name)),
            has_secret=self._has_secret(job),
            has_network_policy=self.config.render.network_policy and self._exists(
                job, "NetworkPolicy", naming.network_policy_name(job.name)),
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

    def _has_secret(self, job: JobView) -> bool:
        """With derived tokens the operator may not read Secrets: it creates the job's once
        per run (an existing one is kept) instead of looking for it."""
        if self.tokens.derived:
            return (job.uid, "Secret") in self._children
        return self._exists(job, "Secret", naming.secret_name(job.name))

    def _exists(self, job: JobView, kind: str, name: str) -> bool:
        """Read once per job; afterwards remembered (children are owned and not edited)."""
        if (job.uid, kind) in self._children:
            return True
        if self.kube.exists(kind, job.namespace, name):
            self._children.add((job.uid, kind))
            return True
        return False

    def _pending(self, key: JobKey, snap: Snapshot) -> frozenset[int]:
        expected = self._expected.get(key, {})
        now = time.monotonic()
        for rank in [r for r, deadline in expected.items() if r in snap.pods or deadline < now]:
            del expected[rank]
        return frozenset(expected)

    # --- the action table ---------------------------------------------------------------

    def _create_secret(self, writer: JobStatusWriter, job: JobView, snap: Snapshot,
                       action: CreateSecret) -> None:
        # Created once; a Secret that exists (another operator's, a restart) is kept as is.
        token, control = self.tokens.new(job.ref)
        if not self.tokens.derived:  # first, so the pods never hold a digest of nothing
            control = self.tokens.keep_control(job.ref, control)
        self.kube.create(children.peer_secret(job.ref, token, control))
        self._children.add((job.uid, "Secret"))

    def _create_service(self, writer: JobStatusWriter, job: JobView, snap: Snapshot,
                        action: CreateService) -> None:
        self.kube.create(action.manifest)
        self._children.add((job.uid, "Service"))

    def _create_network_policy(self, writer: JobStatusWriter, job: JobView, snap: Snapshot,
                               action: CreateNetworkPolicy) -> None:
        self.kube.create(action.manifest)
        self._children.add((job.uid, "NetworkPolicy"))

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

    def _deliver_placement(self, writer: JobStatusWriter, job: JobView, snap: Snapshot,
                           action: DeliverPlacement) -> None:
        """POST the published placement to every sidecar, in the background (a reconcile never
        waits on sidecars); its end wakes the job, whose next reconcile records the outcome in
        the PlacementDelivered condition. Sidecars that do not answer (not started yet, a
        cut-off node, fake nodes) leave the status written and are retried with backoff."""
        key = (job.namespace, job.name)
        pods = dict(snap.pods)
        # A result counts only for the placement and the pods it was sent to.
        what = json.dumps([action.placement, {r: p.ip for r, p in pods.items()}],
                          sort_keys=True)
        call = self.sidecar_calls.take(key, what)
        if isinstance(call, Running):  # its end wakes the job; the requeue is a safety net
            writer.outcomes.append(Outcome(requeue_after=DELIVERY_TIMEOUT_SECONDS + 1.0))
            return
        if isinstance(call, Finished):
            self._delivered(writer, job, call)
            return
        _, due = self._delivery.get(key, (0, 0.0))
        if due > time.monotonic():
            writer.outcomes.append(Outcome(requeue_after=due - time.monotonic()))
            return
        token = self.tokens.of(job.ref)
        if token is None:
            raise RuntimeError(f"the peer-auth Secret of {job.namespace}/{job.name} is missing")

        def deliver() -> int:
            return placement_delivery.deliver(action.placement, pods, self.config.render, token)

        self.sidecar_calls.start(key, what, deliver)

    def _delivered(self, writer: JobStatusWriter, job: JobView, call: Finished) -> None:
        """Record how a finished delivery went; a failed one is retried after a backoff."""
        key = (job.namespace, job.name)
        now = api_time(self._clock())
        error = call.error
        if error is None:
            self._delivery.pop(key, None)
            new = PLACEMENT_DELIVERED.condition(now, job.generation, ranks=call.value)
            writer.outcomes.append(Outcome(conditions=[new],
                                            events=_changed(writer.decided, new)))
            return
        if not isinstance(error, DeliveryError):
            raise error
        failures, _ = self._delivery.get(key, (0, 0.0))
        delay = min(DELIVERY_RETRY_SECONDS * 2 ** failures, DELIVERY_RETRY_MAX_SECONDS)
        self._delivery[key] = (failures + 1, time.monotonic() + delay)
        new = SIDECARS_UNREACHABLE.condition(now, job.generation, failed=error.failed,
                                             ranks=error.total, detail=str(error)[:2000])
        writer.outcomes.append(Outcome(requeue_after=delay, conditions=[new],
                                        events=_changed(writer.decided, new)))

    def _recover(self, writer: JobStatusWriter, job: JobView, snap: Snapshot,
                 action: Recover) -> None:
        writer.outcomes.append(self.recovery.recover(job, snap, action, writer.decided,
                                                      writer))

    def _start_training(self, writer: JobStatusWriter, job: JobView, snap: Snapshot,
                        action: StartTraining) -> None:
        writer.outcomes.append(self.starter.start_training(job, snap, action, writer.decided,
                                                            writer))

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


def _changed(decided: JobStatus, new: Condition) -> list[Event]:
    """An event for a condition an action handler sets, when its reason changes."""
    old = find(decided.conditions, ConditionType(new.type))
    if old is not None and (old.status, old.reason) == (new.status, new.reason):
        return []
    return [Event.of_change(new)]


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
    ranks = {f.rank for a in decision.actions if isinstance(a, Recover) for f in a.failures}
    return ranks or None


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
