"""The phases a recovery and a resume share: Fetching (each rank's shard to where it loads
from), Restarting (every launcher runs the new epoch from the plan's version) and the record
of how it went (status.lastRecovery). Every call is idempotent: a phase repeated by a
restarted operator does no harm."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from datetime import UTC, datetime

from gemini.control.transfers import FetchReplicasRequest, FetchRequest, RestoreRequest
from gemini.domain.recovery import MODE_MEMORY, MODE_S3
from gemini_operator.calls import placement_delivery, sidecars
from gemini_operator.calls.sidecars import TIMEOUT_SECONDS, SidecarError
from gemini_operator.calls.worker_calls import WorkerCalls, launch_record
from gemini_operator.cluster.kube import KubeClient
from gemini_operator.core.apitime import api_time
from gemini_operator.core.conditions import RECOVERY_FINISHED
from gemini_operator.core.events import Event, EventReason
from gemini_operator.core.observed import PodView
from gemini_operator.core.outcome import Outcome, RecoveryWait
from gemini_operator.core.records import (
    RESUME,
    SUPERSEDED,
    LastRecovery,
    PlanRecord,
    RecoveryRecord,
)
from gemini_operator.core.spec import JobSpec
from gemini_operator.core.status import JobStatus
from gemini_operator.core.status_changes import Recovered, StatusWriter
from gemini_operator.core.types import JobView, ReconcileConfig

PHASE_ORDER = (SUPERSEDED, "planning", "replacing", "fetching", "restarting")


class PhaseExecutor:
    """What the recovery and the training-start executors share: the calls to the workers,
    the Fetching/Restarting phases and the clock. Nothing here is per job: what a step writes
    goes through the status writer of the reconcile at hand."""

    def __init__(
        self, kube: KubeClient, config: ReconcileConfig, calls: WorkerCalls,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self.kube, self.config, self.calls = kube, config, calls
        self.restorer = Restorer(self.calls, clock)
        self._clock = clock


class Restorer:
    def __init__(self, calls: WorkerCalls, clock: Callable[[], datetime]) -> None:
        self.calls = calls
        self._clock = clock

    def fetch(self, job: JobView, spec: JobSpec, status: JobStatus,
              record: RecoveryRecord) -> None:
        """The transfers of Fetching; RecoveryWait with their progress while some run (the
        next reconcile asks again and joins them)."""
        try:
            self._fetch(job, spec, status, record)
        except sidecars.TransfersRunning as running:
            raise RecoveryWait(f"transfers under way: {running}") from running

    def _fetch(self, job: JobView, spec: JobSpec, status: JobStatus,
               record: RecoveryRecord) -> None:
        """Fetching: for an S3 plan every sidecar restores the version; for a memory plan,
        replacements get the placement again, ranks sourced from a peer fetch their shard,
        and every holder fetches the replicas it lacks of that version (replacements all of
        them; survivors those that had not arrived yet), so the restored version is on every
        holder: the trainers count it as acknowledged and may reuse their other slot."""
        plan = record.plan
        if plan is None:
            return
        pods = self.calls.running(job, status.restart_attempt, spec.num_nodes)
        token = self.calls.token(job)
        targets = self.calls.sidecars
        if plan.mode == MODE_S3:
            sidecars.restore(targets(pods), token, RestoreRequest(plan.version))
            return
        if plan.mode != MODE_MEMORY:
            return
        if plan.replace_ranks and status.placement is not None:
            placement_delivery.deliver(status.placement.layout, pods, self.calls.ports, token,
                                       timeout=TIMEOUT_SECONDS)
        peers = plan.peer_sources()
        if peers:
            fetches = {r: FetchRequest(r, plan.version, (holder,), "shm")
                       for r, holder in peers.items()}
            sidecars.fetch(targets({r: pods[r] for r in peers}), token, fetches)
        # The version restored, not the newest: survivors may hold newer ones of the abandoned
        # run, and every holder's replicas must match what everyone restores.
        sidecars.fetch_replicas(targets(pods), token, FetchReplicasRequest(version=plan.version))

    def restart(self, job: JobView, spec: JobSpec, status: JobStatus,
                record: RecoveryRecord, writer: StatusWriter) -> Outcome:
        """Restarting: every launcher runs the record's epoch; done once all of them do."""
        plan = record.plan
        pods = self.calls.running(job, status.restart_attempt, spec.num_nodes)
        token = self.calls.token(job)
        source = "s3" if plan is not None and plan.mode == MODE_S3 else "local"
        try:
            self.calls.restart_launchers(job, pods, token, record.epoch,
                                         plan.version if plan else None, source)
        except SidecarError as err:
            raise RecoveryWait(f"a launcher is not reachable yet ({err})") from err
        # A launcher that died after taking the epoch restarts held (epoch 0): send it again.
        epochs = self.calls.launcher_epochs(pods, token)
        behind = sorted(r for r, epoch in epochs.items() if epoch != record.epoch)
        if behind:
            raise RecoveryWait(f"ranks {behind} are not running epoch {record.epoch} yet")
        return self.finish(job, status, record, pods, writer)

    def finish(self, job: JobView, status: JobStatus, record: RecoveryRecord,
               pods: Mapping[int, PodView], writer: StatusWriter) -> Outcome:
        """status.lastRecovery, a new launch record, and the recovery record removed."""
        plan = record.plan or PlanRecord(None, "", "")
        duration = self._clock().timestamp() - record.started_unix
        marks = {**record.marks, "restarting": round(duration, 3)}
        source = plan.source_word
        last = LastRecovery(
            cause=record.kind, message=record.cause[:4096], source=source,
            failed_ranks=record.failed_ranks, steps_lost=plan.steps_lost,
            start_time=record.started_at, detected_at=record.detected_at,
            completion_time=api_time(self._clock()), duration_seconds=round(duration, 3),
            duration_milliseconds=int(duration * 1000), epoch=record.epoch,
            breakdown=breakdown(marks), restored_step=plan.version)
        launch = placement = None
        if status.launch is not None:
            launch = launch_record(record.epoch, status.restart_attempt, pods, self.calls.ports,
                                   job.uid)
        if status.placement is not None and plan.replace_ranks:
            placement = status.placement.moved_to(
                {r: p.node_name for r, p in pods.items()})
        writer.set(Recovered(last, launch, placement))
        if record.kind == RESUME:
            event = Event.of(EventReason.RESUMED_FROM_CHECKPOINT, (
                f"resumed after the suspend from step {plan.version} committed to S3 "
                f"({plan.steps_lost} newer steps were in memory only) in {duration:.1f} s "
                f"(epoch {record.epoch})"))
        else:
            event = Event.of_condition(RECOVERY_FINISHED, (
                f"recovered from {record.cause}: restored step {plan.version} from "
                f"{source.lower()} in {duration:.1f} s (epoch {record.epoch})"))
        return Outcome(finished=last, events=[event])


def breakdown(marks: Mapping[str, float]) -> dict[str, float]:
    """Seconds spent in each phase, from the cumulative marks."""
    out, before = {}, 0.0
    for phase in PHASE_ORDER:
        if phase in marks:
            out[phase] = round(max(0.0, float(marks[phase]) - before), 3)
            before = float(marks[phase])
    return out
