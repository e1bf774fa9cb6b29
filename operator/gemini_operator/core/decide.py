"""The decision of one reconcile of one GeminiJob, as a pure function: observed state in,
decision out.

`decide(observed, config)` runs a short list of guarded steps (invalid spec, finished,
suspended, deadline, children, success, failures, placement, readiness); a step that settles
the job stops the list. The `Decision` holds the actions for the executor (an action table in
`reconciler.py` maps each action type to its handler; actions that talk to workers carry the
spec parsed here), the new status (written only if changed) and the events to send after the
write. No clock is read: `observed.now` is given.

What it reads is in types.py, the actions and the `Decision` in actions.py; the steps share
the draft of the decision (draft.py); the failures step is in decide_failures.py.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import timedelta

from gemini.domain.placement import Machine, Placement, domain_aware_placement, mixed_placement
from gemini_operator.core import children, queueing, render, spares
from gemini_operator.core import conditions as cond
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
    Manifest,
    PatchWorkload,
    SaveBeforeSuspend,
    StartTraining,
)
from gemini_operator.core.apitime import parse_api_time
from gemini_operator.core.conditions import ConditionType
from gemini_operator.core.decide_failures import cannot_start, judge_failures
from gemini_operator.core.draft import Draft, Step, current_pods, delete_active, delete_all, finish
from gemini_operator.core.events import Event, EventReason
from gemini_operator.core.observed import NodeView, PodView
from gemini_operator.core.queueing import WorkloadView
from gemini_operator.core.records import PlacementRecord
from gemini_operator.core.spares import HoldSpares
from gemini_operator.core.spec import (
    JobSpec,
    PlacementStrategy,
    SpecError,
    parse_spec,
    validate_job_name,
)
from gemini_operator.core.status import CheckpointStatus, JobStatus, WorkerCounts
from gemini_operator.core.types import Observed, ReconcileConfig


def decide(observed: Observed, config: ReconcileConfig) -> Decision:
    old = JobStatus.from_dict(observed.job.status)
    draft = Draft(observed, old.with_changes(observed_generation=observed.job.generation))
    try:
        validate_job_name(observed.job.name)
        spec = queueing.admitted_spec(
            parse_spec(observed.job.spec, config.default_sidecar_image),
            observed.workload if observed.queue is not None else None)
        if observed.pod_refused is not None:
            raise SpecError("spec.template.spec", "the API server refused the worker pod "
                            f"rendered from it: {observed.pod_refused}")
        if observed.workload is not None and observed.workload.owner_uid != observed.job.uid:
            raise SpecError("metadata.name", f"the Workload {observed.job.namespace}/"
                            f"{observed.workload.name} exists and is not this job's; it is not "
                            "adopted: delete it, or give the job another name")
        if observed.child_conflict is not None:
            raise SpecError("metadata.name", f"{observed.child_conflict}; it is not adopted "
                            "(it may hold a token or policy someone else chose): delete it, "
                            "or give the job another name")
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
        _finished, _suspended, _deadline, _children, _succeeded, judge_failures, _placement,
        _running,
    )
    for step in steps:
        if step(observed, spec, config, draft):
            break
    _hold_spares(observed, spec, config, draft)
    _queue_workload(observed, spec, config, draft)
    return draft.decision(old)


def _hold_spares(
    observed: Observed, spec: JobSpec | None, config: ReconcileConfig, draft: Draft,
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
    current = current_pods(observed, draft.status.restart_attempt)
    placed = len(current) == spec.num_nodes and all(p.node_name for p in current.values())
    held = spares.decide_spares(observed.job.ref, spec, config.render, observed.spares,
                                observed.nodes, active=active, workers_placed=placed,
                                old=draft.status.spares)
    if held.action is not None:
        draft.actions.append(held.action)
    draft.status = draft.status.with_changes(spares=held.status)
    draft.events.extend(held.events)


def _refuse(draft: Draft, err: SpecError) -> None:
    if draft.is_true(ConditionType.FAILED):
        return
    draft.set(cond.INVALID_SPEC, detail=str(err))
    finish(draft)
    draft.actions.extend(delete_active(draft.observed, "the spec is invalid"))


def _finished(observed: Observed, spec: JobSpec, config: ReconcileConfig, draft: Draft) -> bool:
    if not any(draft.is_true(t) for t in cond.FINISHED_TYPES):
        return False
    draft.actions.extend(delete_active(observed, "the job has finished"))
    ttl = spec.ttl_seconds_after_finished
    finished_at = parse_api_time(draft.status.completion_time)
    if ttl is not None and finished_at is not None:
        left = (finished_at + timedelta(seconds=ttl) - observed.now).total_seconds()
        if left <= 0:
            draft.actions.append(DeleteJob())
        else:
            draft.requeue.append(left)
    return True


def _suspended(observed: Observed, spec: JobSpec, config: ReconcileConfig, draft: Draft) -> bool:
    queued = queueing.holds(observed.queue, observed.workload) or _unmatched_admission(
        observed, spec, config)
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
    current = current_pods(observed, draft.status.restart_attempt)
    if training_started(draft.status) and any(
            p.ip and not p.deleting and not p.terminal for p in current.values()):
        draft.actions.append(SaveBeforeSuspend(spec))  # before the memory goes with the pods
    draft.actions.extend(delete_all(observed, "the job is suspended"))
    return True


def _deadline(observed: Observed, spec: JobSpec, config: ReconcileConfig, draft: Draft) -> bool:
    started = parse_api_time(draft.status.start_time)
    if spec.active_deadline_seconds is None or started is None:
        return False
    left = (started + timedelta(seconds=spec.active_deadline_seconds) - observed.now)
    if left.total_seconds() > 0:
        draft.requeue.append(left.total_seconds())
        return False
    draft.set(cond.DEADLINE_EXCEEDED, seconds=spec.active_deadline_seconds)
    finish(draft)
    draft.actions.extend(delete_active(observed, "the job exceeded its active deadline"))
    return True


def _children(observed: Observed, spec: JobSpec, config: ReconcileConfig, draft: Draft) -> bool:
    """Secret, Service, NetworkPolicy and, until every rank has its pod, the missing worker
    pods. A job made before the operator created policies gets one on its next reconcile."""
    if draft.status.start_time is None:
        draft.status = draft.status.with_changes(start_time=draft.now)
    if not observed.has_secret:
        draft.actions.append(CreateSecret())
    if not observed.has_service:
        service = children.headless_service(observed.job.ref, config.render)
        draft.actions.append(CreateService(service))
    if config.render.network_policy and not observed.has_network_policy:
        policy = children.network_policy(observed.job.ref, config.render)
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


def _succeeded(observed: Observed, spec: JobSpec, config: ReconcileConfig, draft: Draft) -> bool:
    current = current_pods(observed, draft.status.restart_attempt)
    if len(current) < spec.num_nodes or any(p.phase != "Succeeded" for p in current.values()):
        return False
    draft.set(cond.ALL_WORKERS_SUCCEEDED, total=spec.num_nodes)
    draft.set(cond.JOB_COMPLETE, total=spec.num_nodes)
    finish(draft)
    if spec.ttl_seconds_after_finished is not None:
        draft.requeue.append(float(spec.ttl_seconds_after_finished))
    return True


def _placement(observed: Observed, spec: JobSpec, config: ReconcileConfig, draft: Draft) -> bool:
    """Once every worker is scheduled, place replicas by its node's failure domains and publish
    the placement in status (again whenever a rank moved to another node). Delivery to the
    sidecars follows once every worker runs, independently: until all of them took it, the
    executor retries and records how it went in the PlacementDelivered condition."""
    current = current_pods(observed, draft.status.restart_attempt)
    if len(current) < spec.num_nodes or any(not p.node_name for p in current.values()):
        return False
    old = draft.status.placement
    if old is None or not old.on({r: p.node_name for r, p in current.items()}):
        new = placement_record(spec, current, observed.nodes, draft.status.restart_attempt)
        draft.status = draft.status.with_changes(placement=new)
        draft.events.append(Event.of(EventReason.PLACEMENT_COMPUTED, new.layout.reason))
        draft.set(cond.PLACEMENT_PENDING, ranks=spec.num_nodes)
    placement = draft.status.placement
    if (placement is not None and not draft.is_true(ConditionType.PLACEMENT_DELIVERED)
            and all(p.phase == "Running" and p.ip for p in current.values())):
        draft.actions.append(DeliverPlacement(placement))
    return False


def training_started(status: JobStatus) -> bool:
    """Whether the launchers of the current attempt were told to train."""
    return status.launch is not None and status.launch.restart_attempt == status.restart_attempt


def _running(observed: Observed, spec: JobSpec, config: ReconcileConfig, draft: Draft) -> bool:
    current = current_pods(observed, draft.status.restart_attempt)
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
    elif not cannot_start(observed, draft, current):
        draft.set(cond.WORKERS_STARTING, ready=workers.ready, total=spec.num_nodes)
    return True


def placement_record(
    spec: JobSpec, pods: Mapping[int, PodView], nodes: Mapping[str, NodeView], attempt: int,
) -> PlacementRecord:
    """The placement for the scheduled workers (status.placement)."""
    replicas = spec.checkpoint.replicas
    if spec.checkpoint.placement is PlacementStrategy.MIXED:
        placement = mixed_placement(spec.num_nodes, replicas)
    else:
        machines = [_machine(rank, pod.node_name, nodes.get(pod.node_name))
                    for rank, pod in sorted(pods.items())]
        placement = domain_aware_placement(machines, replicas)
    return PlacementRecord(placement, attempt, {r: p.node_name for r, p in pods.items()})


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
    current = current_pods(observed, attempt).values()
    return WorkerCounts(
        total=spec.num_nodes,
        active=sum(1 for p in current if not p.terminal and not p.deleting),
        ready=sum(1 for p in current if p.ready and not p.deleting),
        succeeded=sum(1 for p in current if p.phase == "Succeeded"),
        failed=sum(1 for p in current if p.phase == "Failed"),
    )


def _queue_workload(
    observed: Observed, spec: JobSpec, config: ReconcileConfig, draft: Draft,
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
    elif (not workload.quota_reserved or not observed.pods) and workload.evicted is None:
        # Before any pod runs, even an admitted Workload must ask for what the pods take:
        # one made with smaller pods (by anyone who may write Workloads) would let the job
        # run past its quota.
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


def _unmatched_admission(observed: Observed, spec: JobSpec, config: ReconcileConfig
                         ) -> str | None:
    """Why an admitted Workload does not admit these pods, before any runs: it asks for other
    pod sets or resources than the job's (made for an older version, or by someone else)."""
    workload = observed.workload
    if (observed.queue is None or workload is None or not workload.admitted or observed.pods
            or workload.finished or workload.evicted is not None):
        return None
    changed = workload.shape.differences(
        queueing.shape_of(_workload_manifest(observed, spec, config)["spec"]))
    if not changed:
        return None
    return (f"Workload {workload.name} was admitted for other pods than the job's "
            f"({'; '.join(changed)}): it is made again")


def _remake_if_outdated(workload: WorkloadView, wanted: Manifest, draft: Draft) -> None:
    """A waiting job whose queue label, priority label or spare nodes changed gets a new
    Workload (as Kueue's job integrations do); an admitted one keeps its admission once its
    pods run."""
    changed = workload.shape.differences(queueing.shape_of(wanted["spec"]))
    if changed:
        draft.actions.append(DeleteWorkload(workload.name, (
            f"made for an older version of the job ({'; '.join(changed)}): it is made "
            "again")))


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


def _ranks(ranks: list[int], limit: int = 8) -> str:
    shown = ", ".join(str(r) for r in ranks[:limit])
    more = f" and {len(ranks) - limit} more" if len(ranks) > limit else ""
    return f"rank{'s' if len(ranks) != 1 else ''} {shown}{more}"
