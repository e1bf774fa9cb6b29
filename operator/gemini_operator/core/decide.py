"""The decision of one reconcile of one GeminiJob, as a pure function: observed state in,
decision out.

`decide(observed, config)` runs a short list of guarded steps (invalid spec, finished,
suspended, deadline, children, success, failures, placement, readiness); a step that settles
the job stops the list. The `Decision` holds the actions for the executor (an action table in
`reconciler.py` maps each action type to its handler; actions that talk to workers carry the
spec parsed here), the new status (written only if changed) and the events to send after the
write. No clock is read: `observed.now` is given.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from gemini import rank_detail
from gemini.domain.placement import Machine, Placement, domain_aware_placement, mixed_placement
from gemini.domain.recovery import FailureKind, worst_failure
from gemini_operator.core import conditions as cond
from gemini_operator.core import queueing, render, spares
from gemini_operator.core.apitime import api_time, parse_api_time
from gemini_operator.core.conditions import ConditionType, Reason
from gemini_operator.core.events import Event, EventReason
from gemini_operator.core.failures import (
    Progress,
    RankFailure,
    apply_policy,
    describe,
    detect_failures,
    detect_hang,
    detect_parked,
    log_note,
)
from gemini_operator.core.observed import NodeView, PodView
from gemini_operator.core.queueing import WorkloadView
from gemini_operator.core.records import LaunchRecord
from gemini_operator.core.spares import HoldSpares, SpareView
from gemini_operator.core.spec import (
    JobSpec,
    PlacementStrategy,
    RuleAction,
    SpecError,
    parse_spec,
    validate_job_name,
)
from gemini_operator.core.status import CheckpointStatus, JobStatus, WorkerCounts

Manifest = dict[str, Any]


@dataclass(frozen=True)
class JobView:
    name: str
    namespace: str
    uid: str
    generation: int
    spec: Mapping[str, Any]
    status: Mapping[str, Any] | None = None
    labels: Mapping[str, str] = field(default_factory=dict)

    @property
    def ref(self) -> render.JobRef:
        return render.JobRef(self.name, self.namespace, self.uid)

    @staticmethod
    def from_object(obj: Mapping[str, Any]) -> JobView:
        meta = obj.get("metadata") or {}
        return JobView(
            name=str(meta.get("name", "")),
            namespace=str(meta.get("namespace", "")),
            uid=str(meta.get("uid", "")),
            generation=int(meta.get("generation", 0)),
            spec=obj.get("spec") or {},
            status=obj.get("status"),
            labels=dict(meta.get("labels") or {}),
        )


@dataclass(frozen=True)
class Observed:
    job: JobView
    pods: Mapping[int, PodView]  # the worker pod of each rank (one name per rank)
    nodes: Mapping[str, NodeView]
    has_service: bool
    has_secret: bool
    now: datetime
    pending_creates: frozenset[int] = frozenset()  # created by us, not yet seen in the cache
    has_network_policy: bool = False
    # Ranks whose pod name is still taken by a pod of an earlier job of the same name.
    foreign_ranks: frozenset[int] = frozenset()
    process_exits: Mapping[int, int] = field(default_factory=dict)  # from the launchers
    # Ranks whose training failed while their launcher stays up (poller.py), with the
    # launcher's words; those also in process_exits exited, the others are parked alive.
    parked: Mapping[int, str] = field(default_factory=dict)
    progress: Progress | None = None
    checkpoint: CheckpointStatus | None = None  # from the sidecars (poller.py)
    spares: Mapping[int, SpareView] = field(default_factory=dict)  # by spare index
    # The API server refused a worker pod rendered from this spec (422): its message.
    pod_refused: str | None = None
    # The job's Kueue Workload, read when the job names a queue (queueing.py).
    workload: WorkloadView | None = None

    @property
    def queue(self) -> str | None:
        return queueing.queue_name(self.job.labels)


@dataclass(frozen=True)
class ReconcileConfig:
    render: render.RenderConfig = field(default_factory=render.RenderConfig)
    default_sidecar_image: str | None = None
    token_key: bytes | None = field(default=None, repr=False)  # tokens.py
    # Per-rank status detail larger than this goes to a ConfigMap (gemini.rank_detail).
    status_inline_bytes: int = rank_detail.DEFAULT_INLINE_BYTES


# Actions: what the executor does, in this order.
@dataclass(frozen=True)
class CreateSecret:
    """The per-job peer-auth Secret; the executor generates the token."""


@dataclass(frozen=True)
class CreateService:
    manifest: Manifest


@dataclass(frozen=True)
class CreateNetworkPolicy:
    manifest: Manifest


@dataclass(frozen=True)
class CreatePods:
    manifests: tuple[Manifest, ...]


@dataclass(frozen=True)
class DeletePods:
    names: tuple[str, ...]
    reason: str


@dataclass(frozen=True)
class DeliverPlacement:
    """Tell every sidecar whose shards it holds and where its peers are."""

    placement: Mapping[str, Any]


@dataclass(frozen=True)
class Recover:
    """Recover from `failures` (planned with gemini.domain's planner by the executor, which
    reads the sidecars' inventory first)."""

    kind: FailureKind
    failures: tuple[RankFailure, ...]
    spec: JobSpec


@dataclass(frozen=True)
class SaveBeforeSuspend:
    """Persist and commit the newest step complete in memory before the pods are deleted
    (bounded; the executor says in events what was kept)."""

    spec: JobSpec


@dataclass(frozen=True)
class StartTraining:
    """Every worker runs and has its placement: tell every launcher to start epoch 1 (or,
    after a suspend, restore the committed step first)."""

    spec: JobSpec


@dataclass(frozen=True)
class DeleteJob:
    """The TTL after finishing has passed."""


@dataclass(frozen=True)
class CreateWorkload:
    """The job's Kueue Workload (queueing.py)."""

    manifest: Manifest


@dataclass(frozen=True)
class DeleteWorkload:
    """The Workload of a job the user suspended, once its pods are gone (a suspended job
    holds no quota: resuming makes a new one, queued again), of a job no longer labelled for
    a queue, or one made for an older version of a waiting job (made again)."""

    name: str
    why: str


@dataclass(frozen=True)
class PatchWorkload:
    """A status patch of the job's Workload: finished, or its quota handed back."""

    name: str
    patch: Manifest
    what: str


Action = (
    CreateSecret | CreateService | CreateNetworkPolicy | CreatePods | DeletePods
    | DeliverPlacement | Recover | StartTraining | DeleteJob | HoldSpares | SaveBeforeSuspend
    | CreateWorkload | PatchWorkload | DeleteWorkload
)


@dataclass(frozen=True)
class Decision:
    status: JobStatus
    actions: tuple[Action, ...] = ()
    events: tuple[Event, ...] = ()
    requeue_after: float | None = None  # seconds until the next time-based check


class _Draft:
    """What the steps accumulate; turned into the frozen Decision at the end."""

    def __init__(self, observed: Observed, status: JobStatus) -> None:
        self.observed = observed
        self.now = api_time(observed.now)
        self.generation = observed.job.generation
        self.status = status
        self.actions: list[Action] = []
        self.events: list[Event] = []
        self.requeue: list[float] = []

    def set(self, reason: Reason, **values: object) -> None:
        new = reason.condition(self.now, self.generation, **values)
        self.status = self.status.with_changes(
            conditions=cond.upsert(self.status.conditions, new)
        )

    def is_true(self, kind: ConditionType) -> bool:
        return cond.is_true(self.status.conditions, kind)

    def decision(self, old: JobStatus) -> Decision:
        events = _transition_events(old, self.status) + self.events
        after = min(self.requeue) if self.requeue else None
        return Decision(self.status, tuple(self.actions), tuple(events), after)


Step = Callable[[Observed, JobSpec, ReconcileConfig, _Draft], bool]


def decide(observed: Observed, config: ReconcileConfig) -> Decision:
    old = JobStatus.from_dict(observed.job.status)
    draft = _Draft(observed, old.with_changes(observed_generation=observed.job.generation))
    try:
        validate_job_name(observed.job.name)
        spec = queueing.admitted_spec(
            parse_spec(observed.job.spec, config.default_sidecar_image),
            observed.workload if observed.queue is not None else None)
        if observed.pod_refused is not None:
            raise SpecError("spec.template.spec", "the API server refused the worker pod "
                            f"rendered from it: {observed.pod_refused}")
    except SpecError as err:
        _refuse(draft, err)
        _hold_spares(observed, None, config, draft)
        return draft.decision(old)
    draft.status = draft.status.with_changes(workers=_counts(observed, spec, old.restart_attempt))
    if observed.checkpoint is not None:
        draft.events.extend(persist_events(draft.status.checkpoint, observed.checkpoint))
        draft.events.extend(interval_events(draft.status.checkpoint, observed.checkpoint))
        draft.status = draft.status.with_changes(checkpoint=observed.checkpoint)
    steps: tuple[Step, ...] = (
        _finished, _suspended, _deadline, _children, _succeeded, _failures, _placement, _running,
    )
    for step in steps:
        if step(observed, spec, config, draft):
            break
    _hold_spares(observed, spec, config, draft)
    _queue_workload(observed, spec, config, draft)
    return draft.decision(old)


def _hold_spares(
    observed: Observed, spec: JobSpec | None, config: ReconcileConfig, draft: _Draft,
) -> None:
    """Spare placeholders (spares.py) while the job runs, whatever the steps decided; none
    for a finished, suspended or invalid job."""
    if spec is None:
        names = tuple(sorted(s.name for s in observed.spares.values() if not s.deleting))
        if names:
            draft.actions.append(HoldSpares(delete=names))
        return
    active = not draft.is_true(ConditionType.SUSPENDED) and not any(
        draft.is_true(t) for t in cond.FINISHED_TYPES)
    current = _current_pods(observed, draft.status.restart_attempt)
    placed = len(current) == spec.num_nodes and all(p.node_name for p in current.values())
    held = spares.decide_spares(observed.job.ref, spec, config.render, observed.spares,
                              observed.nodes, active=active, workers_placed=placed,
                              old=draft.status.spares)
    if held.action is not None:
        draft.actions.append(held.action)
    draft.status = draft.status.with_changes(spares=held.status)
    draft.events.extend(held.events)


def _refuse(draft: _Draft, err: SpecError) -> None:
    if draft.is_true(ConditionType.FAILED):
        return
    draft.set(cond.INVALID_SPEC, detail=str(err))
    _finish(draft)
    draft.actions.extend(_delete_active(draft.observed, "the spec is invalid"))


def _finished(observed: Observed, spec: JobSpec, config: ReconcileConfig, draft: _Draft) -> bool:
    if not any(draft.is_true(t) for t in cond.FINISHED_TYPES):
        return False
    draft.actions.extend(_delete_active(observed, "the job has finished"))
    ttl = spec.ttl_seconds_after_finished
    finished_at = parse_api_time(draft.status.completion_time)
    if ttl is not None and finished_at is not None:
        left = (finished_at + timedelta(seconds=ttl) - observed.now).total_seconds()
        if left <= 0:
            draft.actions.append(DeleteJob())
        else:
            draft.requeue.append(left)
    return True


def _suspended(observed: Observed, spec: JobSpec, config: ReconcileConfig, draft: _Draft) -> bool:
    queued = queueing.holds(observed.queue, observed.workload)
    if not spec.suspend and queued is None:
        if draft.is_true(ConditionType.SUSPENDED):
            if observed.workload is not None and observed.queue is not None:
                draft.set(cond.JOB_ADMITTED, workload=observed.workload.name)
            else:
                draft.set(cond.JOB_RESUMED)
            # Pods that ran before get successors of a new attempt; the deadline clock
            # restarts, as for a Job.
            had_pods = cond.find(draft.status.conditions, ConditionType.CREATED) is not None
            # The new pods get a placement of their own (delivered to their sidecars), and
            # training resumes from S3 (recovery.py) since the old pods took their memory.
            draft.status = draft.status.with_changes(
                restart_attempt=draft.status.restart_attempt + (1 if had_pods else 0),
                start_time=None, placement=None,
            )
        return False
    if queued is not None and not spec.suspend:
        draft.set(cond.JOB_QUEUED, why=queued)
        draft.requeue.append(queueing.POLL_SECONDS)  # in case the Workload's watch misses it
    elif not draft.is_true(ConditionType.SUSPENDED) or queued is not None:
        draft.set(cond.JOB_SUSPENDED)  # the user's suspend wins over the queue's
    if draft.is_true(ConditionType.CREATED):
        draft.set(cond.WORKERS_DELETED)
    draft.set(cond.RUNNING_SUSPENDED)
    if draft.is_true(ConditionType.RECOVERING):
        draft.set(cond.RECOVERY_SUSPENDED)  # its pods go: resume restores instead
    draft.status = draft.status.with_changes(start_time=None, recovery=None)
    current = _current_pods(observed, draft.status.restart_attempt)
    if training_started(draft.status) and any(
            p.ip and not p.deleting and not p.terminal for p in current.values()):
        draft.actions.append(SaveBeforeSuspend(spec))  # before the memory goes with the pods
    draft.actions.extend(_delete_all(observed, "the job is suspended"))
    return True


def _deadline(observed: Observed, spec: JobSpec, config: ReconcileConfig, draft: _Draft) -> bool:
    started = parse_api_time(draft.status.start_time)
    if spec.active_deadline_seconds is None or started is None:
        return False
    left = (started + timedelta(seconds=spec.active_deadline_seconds) - observed.now)
    if left.total_seconds() > 0:
        draft.requeue.append(left.total_seconds())
        return False
    draft.set(cond.DEADLINE_EXCEEDED, seconds=spec.active_deadline_seconds)
    _finish(draft)
    draft.actions.extend(_delete_active(observed, "the job exceeded its active deadline"))
    return True


def _children(observed: Observed, spec: JobSpec, config: ReconcileConfig, draft: _Draft) -> bool:
    """Secret, Service, NetworkPolicy and, until every rank has its pod, the missing worker
    pods. A job made before the operator created policies gets one on its next reconcile."""
    if draft.status.start_time is None:
        draft.status = draft.status.with_changes(start_time=draft.now)
    if not observed.has_secret:
        draft.actions.append(CreateSecret())
    if not observed.has_service:
        service = render.headless_service(observed.job.ref, config.render)
        draft.actions.append(CreateService(service))
    if config.render.network_policy and not observed.has_network_policy:
        policy = render.network_policy(observed.job.ref, config.render)
        draft.actions.append(CreateNetworkPolicy(policy))
    if draft.is_true(ConditionType.CREATED):
        return False
    attempt = draft.status.restart_attempt
    stale = [p.name for p in observed.pods.values() if p.attempt != attempt and not p.deleting]
    if stale:
        older = "the pod belongs to an older attempt"
        draft.actions.append(DeletePods(tuple(sorted(stale)), older))
    missing = [r for r in range(spec.num_nodes) if r not in observed.pods
               and r not in observed.pending_creates and r not in observed.foreign_ranks]
    if missing:
        draft.actions.append(CreatePods(tuple(
            _worker(observed, spec, config, rank, attempt) for rank in missing
        )))
        draft.events.append(Event.of(EventReason.CREATED_WORKERS,
                                      f"created worker pods for {_ranks(missing)}"))
    waiting = [r for r in range(spec.num_nodes) if r in observed.foreign_ranks
               or (r in observed.pods and observed.pods[r].attempt != attempt)]
    if not waiting:
        draft.set(cond.CHILDREN_CREATED, workers=spec.num_nodes)
    return True  # the pods are new: nothing else to judge until they are observed


def _succeeded(observed: Observed, spec: JobSpec, config: ReconcileConfig, draft: _Draft) -> bool:
    current = _current_pods(observed, draft.status.restart_attempt)
    if len(current) < spec.num_nodes or any(p.phase != "Succeeded" for p in current.values()):
        return False
    draft.set(cond.ALL_WORKERS_SUCCEEDED, total=spec.num_nodes)
    _finish(draft)
    if spec.ttl_seconds_after_finished is not None:
        draft.requeue.append(float(spec.ttl_seconds_after_finished))
    return True


def _failures(observed: Observed, spec: JobSpec, config: ReconcileConfig, draft: _Draft) -> bool:
    current = _current_pods(observed, draft.status.restart_attempt)
    expected = frozenset(
        r for r in range(spec.num_nodes)
        if r not in observed.pending_creates and not (r in current and current[r].phase ==
                                                         "Succeeded")
    )
    exits = {**trainer_exits(current, draft.status.launch, draft.status.restart_attempt),
             **observed.process_exits}
    failures = detect_failures(current, observed.nodes, spec.num_nodes, expected, exits,
                               observed.parked)
    if not failures and not draft.is_true(ConditionType.RECOVERING):
        # Only when nothing else failed: a process parks when a peer's failure broke its
        # collective too, and that failure is the one to recover from.
        failures = detect_parked({r: e for r, e in observed.parked.items() if r not in exits},
                                 expected)
    if not failures:
        failures = detect_hang(observed.progress, observed.now,
                               spec.failure_policy.hang_timeout_seconds, sorted(expected))
    if draft.is_true(ConditionType.RECOVERING):
        _cannot_start(observed, draft, current)
        if _failed_again(observed, spec, draft, current):
            return True
        # A recovery is under way (perhaps begun by a previous operator): continue it.
        draft.actions.append(Recover(_kind(failures), failures, spec))
        return True
    if not failures:
        if observed.progress is not None:
            # A hung job changes nothing that would call for a reconcile: come back when the
            # hang timeout runs out.
            since = (observed.now - observed.progress.since).total_seconds()
            left = spec.failure_policy.hang_timeout_seconds - since
            draft.requeue.append(max(1.0, left + 1.0))
        return False
    _decide_recovery(spec, draft, failures)
    return True


def _failed_again(observed: Observed, spec: JobSpec, draft: _Draft,
                  current: Mapping[int, PodView]) -> bool:
    """Whether the recovery under way failed itself: a launcher took the recovery's epoch and
    its training process died again (a script that dies at start dies on every restart, and
    its launcher exits before the recovery sees it run). That is a new failure: it counts as
    a restart, or fails the job once maxRestarts are used up; the next recovery begins from
    the epoch that failed, and its trainer restarts count from now."""
    record = draft.status.recovery
    launch = draft.status.launch
    attempt = draft.status.restart_attempt
    exits = relaunch_exits(current, launch, attempt)
    if record is None or launch is None or not exits:
        return False
    failures = detect_failures(current, observed.nodes, spec.num_nodes, frozenset(exits), exits)
    if not failures:
        return False
    draft.status = draft.status.with_changes(recovery=None, launch=LaunchRecord(
        epoch=record.epoch, restart_attempt=attempt,
        trainer_restarts={r: p.trainer_restarts for r, p in current.items()},
        pod_uids={r: p.uid for r, p in current.items()}))
    _decide_recovery(spec, draft, failures)
    if draft.is_true(ConditionType.RECOVERING):  # unchanged, so no transition event: say it
        again = cond.find(draft.status.conditions, ConditionType.RECOVERING)
        message = again.message if again is not None else describe(failures)
        draft.events.append(Event.of_condition(
            cond.RECOVERY_NEEDED, f"the recovery's epoch {record.epoch} failed too: {message}"))
    return True


def _cannot_start(observed: Observed, draft: _Draft, current: Mapping[int, PodView]) -> bool:
    """Running False, naming a pod and why, when workers cannot start without help from
    outside (the scheduler cannot place them, a Secret or ConfigMap is missing, an image
    cannot be pulled): the reason would otherwise be only in the pods' events."""
    stuck = sorted((p.name, p.start_problem) for p in current.values()
                   if p.start_problem and not p.deleting)
    if not stuck:
        return False
    name, problem = stuck[0]
    more = f" (and {len(stuck) - 1} more pods)" if len(stuck) > 1 else ""
    draft.set(cond.WORKERS_CANNOT_START, pod=name, problem=problem, more=more)
    return True


def _decide_recovery(spec: JobSpec, draft: _Draft, failures: tuple[RankFailure, ...]) -> None:
    decision = apply_policy(spec.failure_policy, failures)
    cause = describe(failures)
    if decision.action is RuleAction.FAIL_JOB:
        rule = decision.rule.name if decision.rule else ""
        draft.set(cond.FAILURE_POLICY_FAIL_JOB, cause=cause, rule=rule, log=log_note(failures))
        _finish(draft)
        draft.actions.extend(_delete_active(draft.observed, "the failure policy failed the job"))
        return
    if decision.counts and draft.status.restarts >= spec.failure_policy.max_restarts:
        draft.set(cond.MAX_RESTARTS_EXCEEDED, cause=cause, restarts=draft.status.restarts,
                  log=log_note(failures))
        _finish(draft)
        draft.actions.extend(_delete_active(draft.observed, "the job ran out of restarts"))
        return
    kind = _kind(failures)
    draft.set(cond.RECOVERY_NEEDED, cause=cause, intent=_intent(kind))
    if decision.counts:
        draft.status = draft.status.with_changes(restarts=draft.status.restarts + 1)
    draft.actions.append(Recover(kind, failures, spec))


def _placement(observed: Observed, spec: JobSpec, config: ReconcileConfig, draft: _Draft) -> bool:
    """Once every worker is scheduled, place replicas by its node's failure domains and publish
    the placement in status (again whenever a rank moved to another node). Delivery to the
    sidecars follows once every worker runs, independently: until all of them took it, the
    executor retries and records how it went in the PlacementDelivered condition."""
    current = _current_pods(observed, draft.status.restart_attempt)
    if len(current) < spec.num_nodes or any(not p.node_name for p in current.values()):
        return False
    nodes = {str(r): p.node_name for r, p in sorted(current.items())}
    old = draft.status.placement
    if old is None or old.get("nodes") != nodes:
        doc = placement_document(spec, current, observed.nodes, draft.status.restart_attempt)
        draft.status = draft.status.with_changes(placement=doc)
        draft.events.append(Event.of(EventReason.PLACEMENT_COMPUTED, str(doc["reason"])))
        draft.set(cond.PLACEMENT_PENDING, ranks=spec.num_nodes)
    placement = draft.status.placement
    if (placement is not None and not draft.is_true(ConditionType.PLACEMENT_DELIVERED)
            and all(p.phase == "Running" and p.ip for p in current.values())):
        draft.actions.append(DeliverPlacement(placement))
    return False


def trainer_exits(
    pods: Mapping[int, PodView], launch: LaunchRecord | None, attempt: int,
) -> dict[int, int]:
    """Ranks whose trainer container restarted since the launchers were last told to run
    (the launcher exits when training fails), with the exit code it ended with."""
    if launch is None or launch.restart_attempt != attempt:
        return {}
    exits = {}
    for rank, pod in pods.items():
        same_pod = launch.pod_uids.get(rank) == pod.uid
        base = launch.trainer_restarts.get(rank, 0) if same_pod else 0
        if pod.trainer_restarts > base:
            code = pod.trainer_last_exit.exit_code if pod.trainer_last_exit else 1
            exits[rank] = code or 1
    return exits


def relaunch_exits(
    pods: Mapping[int, PodView], launch: LaunchRecord | None, attempt: int,
) -> dict[int, int]:
    """During a recovery: ranks whose trainer container restarted more often than the failed
    epoch explains, with the exit code it ended with. A launcher of the failed epoch ends at
    most once more (its process may die after the failure was seen), then holds until told
    the recovery's epoch; so a further restart is that epoch's process dying. A pod new since
    the launch (a replacement) has no failed epoch to end: any restart counts."""
    if launch is None or launch.restart_attempt != attempt:
        return {}
    exits = {}
    for rank, pod in pods.items():
        same_pod = launch.pod_uids.get(rank) == pod.uid
        allowed = launch.trainer_restarts.get(rank, 0) + 1 if same_pod else 0
        if pod.trainer_restarts > allowed:
            code = pod.trainer_last_exit.exit_code if pod.trainer_last_exit else 1
            exits[rank] = code or 1
    return exits


def training_started(status: JobStatus) -> bool:
    """Whether the launchers of the current attempt were told to train."""
    return status.launch is not None and status.launch.restart_attempt == status.restart_attempt


def _running(observed: Observed, spec: JobSpec, config: ReconcileConfig, draft: _Draft) -> bool:
    current = _current_pods(observed, draft.status.restart_attempt)
    if (not training_started(draft.status) and draft.status.placement is not None
            and draft.is_true(ConditionType.PLACEMENT_DELIVERED)
            and len(current) == spec.num_nodes
            and all(p.phase == "Running" and p.ip for p in current.values())):
        draft.actions.append(StartTraining(spec))
    workers = draft.status.workers
    if workers.ready == spec.num_nodes:
        draft.set(cond.ALL_WORKERS_READY, total=spec.num_nodes)
    elif (done := sum(1 for p in current.values() if p.training_done)) and (
            workers.ready + done == spec.num_nodes):
        # the last steps: pods end one by one, each after its sidecar stops; still Running,
        # never back to "starting"
        draft.set(cond.WORKERS_FINISHING, succeeded=done, total=spec.num_nodes)
    elif not _cannot_start(observed, draft, current):
        draft.set(cond.WORKERS_STARTING, ready=workers.ready, total=spec.num_nodes)
    return True


def placement_document(
    spec: JobSpec, pods: Mapping[int, PodView], nodes: Mapping[str, NodeView], attempt: int,
) -> dict[str, Any]:
    """The placement for the scheduled workers, as status.placement stores it."""
    replicas = spec.checkpoint.replicas
    if spec.checkpoint.placement is PlacementStrategy.MIXED:
        placement = mixed_placement(spec.num_nodes, replicas)
    else:
        machines = [_machine(rank, pod.node_name, nodes.get(pod.node_name))
                    for rank, pod in sorted(pods.items())]
        placement = domain_aware_placement(machines, replicas)
    doc = placement.to_dict()
    doc["restartAttempt"] = attempt
    doc["nodes"] = {str(r): p.node_name for r, p in sorted(pods.items())}
    return doc


def peer_assignment(
    placement: Placement, rank: int, job: render.JobRef, config: render.RenderConfig,
) -> render.PeerAssignment:
    """Rank `rank`'s part of `placement`, with its peers' stable DNS addresses."""
    holds, sends = placement.receives_from(rank), placement.sends_to(rank)
    peers = {r: f"{render.worker_host(job, r, config)}:{config.sidecar_port}"
             for r in sorted(set(holds) | set(sends))}
    return render.PeerAssignment(hold_ranks=holds, send_to=sends, peers=peers)


def _worker(
    observed: Observed, spec: JobSpec, config: ReconcileConfig, rank: int, attempt: int
) -> Manifest:
    assignment = None
    if spec.checkpoint.placement is PlacementStrategy.MIXED:
        # Known before scheduling: Mixed placement depends on ranks only.
        placement = mixed_placement(spec.num_nodes, spec.checkpoint.replicas)
        assignment = peer_assignment(placement, rank, observed.job.ref, config.render)
    return render.worker_pod(observed.job.ref, spec, rank, attempt, config.render, assignment)


def _machine(rank: int, node_name: str, node: NodeView | None) -> Machine:
    if node is None:
        return Machine(rank=rank, node=node_name)
    return Machine(rank=rank, node=node_name, zone=node.zone, rack=node.rack)


def _counts(observed: Observed, spec: JobSpec, attempt: int) -> WorkerCounts:
    current = _current_pods(observed, attempt).values()
    return WorkerCounts(
        total=spec.num_nodes,
        active=sum(1 for p in current if not p.terminal and not p.deleting),
        ready=sum(1 for p in current if p.ready and not p.deleting),
        succeeded=sum(1 for p in current if p.phase == "Succeeded"),
        failed=sum(1 for p in current if p.phase == "Failed"),
    )


def _queue_workload(
    observed: Observed, spec: JobSpec, config: ReconcileConfig, draft: _Draft,
) -> None:
    """The job's Kueue Workload (queueing.py): made while the job waits, told whether every
    worker is ready (PodsReady, for Kueue's waitForPodsReady), marked Finished when the job
    ends, its quota handed back once the pods of an evicted job are gone, deleted once the
    pods of a job the user suspended are gone, deleted when the job leaves the queue, made
    again when a waiting job's queue, priority or spares change."""
    queue, workload = observed.queue, observed.workload
    if queue is None:
        if workload is not None:
            draft.actions.append(DeleteWorkload(workload.name, (
                f"the job's {queueing.QUEUE_LABEL} label was removed: it runs outside "
                "Kueue's quota")))
        if queueing.was_queued(observed.job.status) and not draft.is_true(
                ConditionType.SUSPENDED):
            draft.set(cond.JOB_LEFT_QUEUE)  # and the Workload is not looked for again
        return
    if any(draft.is_true(t) for t in cond.FINISHED_TYPES):
        if workload is not None and not workload.finished:
            succeeded = draft.is_true(ConditionType.SUCCEEDED)
            found = cond.find(draft.status.conditions,
                              ConditionType.SUCCEEDED if succeeded else ConditionType.FAILED)
            message = found.message if found is not None else "the job has finished"
            draft.actions.append(PatchWorkload(workload.name, queueing.finished_patch(
                workload, succeeded, message, draft.now), "mark it Finished"))
        return
    if spec.suspend:
        if workload is not None and not observed.pods:
            draft.actions.append(DeleteWorkload(
                workload.name, "the job is suspended (resuming queues it again)"))
        return
    if workload is None:
        draft.actions.append(CreateWorkload(_workload_manifest(observed, spec, config)))
    elif not workload.quota_reserved and workload.evicted is None:
        _remake_if_outdated(workload, _workload_manifest(observed, spec, config), draft)
    elif workload.evicted is not None:
        if workload.quota_reserved and not observed.pods:
            draft.actions.append(PatchWorkload(workload.name, queueing.release_patch(
                workload, draft.now), "hand its quota back after the eviction"))
    elif workload.admitted:
        running = cond.find(draft.status.conditions, ConditionType.RUNNING)
        ready = running is not None and running.status == "True"
        if ready != workload.pods_ready:
            message = running.message if running is not None else "no worker is ready"
            draft.actions.append(PatchWorkload(workload.name, queueing.pods_ready_patch(
                workload, ready, message, draft.now), f"PodsReady {ready}: {message}"))


def _workload_manifest(observed: Observed, spec: JobSpec, config: ReconcileConfig
                       ) -> Manifest:
    worker = render.worker_pod(observed.job.ref, spec, 0, 0, config.render)
    spare = spares.spare_pod(observed.job.ref, spec, 0, config.render)
    return queueing.workload_manifest(observed.job.ref, observed.job.labels, worker,
                                      spec.num_nodes, spare, spec.failure_policy.spare_nodes)


def _remake_if_outdated(workload: WorkloadView, wanted: Manifest, draft: _Draft) -> None:
    """A waiting job whose queue label, priority label or spare nodes changed gets a new
    Workload (as Kueue's job integrations do); an admitted one keeps its admission."""
    changed = workload.shape.differences(queueing.shape_of(wanted["spec"]))
    if changed:
        draft.actions.append(DeleteWorkload(workload.name, (
            f"made for an older version of the job ({'; '.join(changed)}): it is made "
            "again")))


def _current_pods(observed: Observed, attempt: int) -> dict[int, PodView]:
    return {r: p for r, p in observed.pods.items() if p.attempt == attempt}


def _delete_all(observed: Observed, reason: str) -> list[Action]:
    names = sorted(p.name for p in observed.pods.values() if not p.deleting)
    return [DeletePods(tuple(names), reason)] if names else []


def _delete_active(observed: Observed, reason: str) -> list[Action]:
    """Stop the pods still running; finished ones stay for their logs and exit codes."""
    names = sorted(p.name for p in observed.pods.values() if not p.terminal and not p.deleting)
    return [DeletePods(tuple(names), reason)] if names else []


def _finish(draft: _Draft) -> None:
    if draft.status.completion_time is None:
        draft.status = draft.status.with_changes(completion_time=draft.now)
    draft.set(cond.JOB_FINISHED)
    if draft.is_true(ConditionType.RECOVERING):  # a finished job recovers nothing more
        draft.set(cond.RECOVERY_ABANDONED)
        draft.status = draft.status.with_changes(recovery=None)


def _kind(failures: tuple[RankFailure, ...]) -> FailureKind:
    return worst_failure(f.kind for f in failures) or FailureKind.SOFTWARE


def _intent(kind: FailureKind) -> str:
    if kind is FailureKind.HARDWARE:
        return "replacing the lost ranks; the others restore from their own memory"
    return "restarting every training process in place from local memory"


def persist_events(old: CheckpointStatus, new: CheckpointStatus) -> list[Event]:
    """A warning when persisting to S3 starts failing, and a note when it works again (once
    per outage: the retries in between change only the message in status)."""
    if new.persist_error and not old.persist_error:
        return [Event.of(EventReason.PERSIST_FAILED, "persisting to S3 failed (training goes "
                         f"on, retrying): {new.persist_error}")]
    if old.persist_error and not new.persist_error and new.persisted_step is not None:
        return [Event.of(EventReason.PERSIST_RECOVERED, f"persisted step {new.persisted_step} "
                         "to S3 after earlier failures")]
    return []


def interval_events(old: CheckpointStatus, new: CheckpointStatus) -> list[Event]:
    """A warning when replication lags so that snapshots are skipped (the interval between
    them grows), and a note when every step is snapshotted again; each saying why."""
    before, after = old.effective_interval or 1, new.effective_interval or 1
    if after > 1 and before == 1:
        return [Event.of(EventReason.CHECKPOINT_INTERVAL_LENGTHENED, (
            f"a checkpoint every {after} steps instead of every step: replication lags "
            f"({new.interval_reason or 'no measurement yet'}); the trainers keep step "
            f"{new.recoverable_step} until the newer one is on every holder"))]
    if after == 1 and before > 1:
        return [Event.of(EventReason.CHECKPOINT_INTERVAL_RESTORED, (
            f"a checkpoint every step again ({new.interval_reason or 'replication keeps up'})"
        ))]
    return []


def _transition_events(old: JobStatus, new: JobStatus) -> list[Event]:
    """An event for every condition whose status or reason changed."""
    before = {c.type: (c.status, c.reason) for c in old.conditions}
    return [Event.of_change(c) for c in new.conditions
            if before.get(c.type) != (c.status, c.reason)]


def _ranks(ranks: list[int], limit: int = 8) -> str:
    shown = ", ".join(str(r) for r in ranks[:limit])
    more = f" and {len(ranks) - limit} more" if len(ranks) > limit else ""
    return f"rank{'s' if len(ranks) != 1 else ''} {shown}{more}"
