"""Starting training: the first start of an attempt's launchers, or, when training ran before
a suspend, the resume from the newest step committed to S3.

A resume is recorded in status.recovery (kind resume, phases Fetching -> Restarting) like a
recovery, each phase written before it acts, so a restarted operator goes on. With nothing
committed, training starts over (and an event says why); while S3 cannot be listed, the
resume waits rather than throw the saved steps away.
"""

from __future__ import annotations

import logging

from gemini.domain.recovery import MODE_S3, RankSource, RecoveryPlan
from gemini_operator.calls.sidecars import SidecarError
from gemini_operator.calls.worker_calls import (
    launch_record,
    rendezvous_port,
)
from gemini_operator.cluster.cache import Snapshot
from gemini_operator.core.actions import StartTraining
from gemini_operator.core.apitime import api_time
from gemini_operator.core.events import Event, EventReason
from gemini_operator.core.outcome import Outcome, RecoveryWait, S3Unreadable
from gemini_operator.core.records import RESUME, PlanRecord, RecoveryPhase, RecoveryRecord
from gemini_operator.core.spec import JobSpec
from gemini_operator.core.status import JobStatus
from gemini_operator.core.status_changes import Launched, RecoveryAt, StatusWriter
from gemini_operator.core.types import JobView
from gemini_operator.steps.restore import PhaseExecutor

log = logging.getLogger(__name__)
WAIT_SECONDS = 0.25
S3_RETRY_SECONDS = 10.0


def resuming(status: JobStatus) -> bool:
    """Whether training ran in an earlier attempt (before a suspend) and not yet in this one,
    or a resume is under way."""
    if status.recovery is not None and status.recovery.kind == RESUME:
        return True
    return status.launch is not None and status.launch.restart_attempt != status.restart_attempt


class TrainingStarter(PhaseExecutor):
    """Starts training: a job's first epoch, or its resume after a suspend."""

    def start_training(self, job: JobView, snap: Snapshot, action: StartTraining,
                       status: JobStatus, writer: StatusWriter) -> Outcome:
        if resuming(status):
            return self._resume(job, snap, action.spec, status, writer)
        return self._start(job, snap, status, writer)

    def _start(self, job: JobView, snap: Snapshot, status: JobStatus, writer: StatusWriter,
               note: Event | None = None) -> Outcome:
        """Every launcher of the attempt starts the next epoch from scratch."""
        pods = self.calls.cached(snap, status.restart_attempt)
        epoch = (status.launch.epoch if status.launch is not None else 0) + 1
        try:
            self.calls.restart_launchers(job, pods, self.calls.token(job), epoch, None, "local")
        except SidecarError as err:
            log.info("launchers of %s/%s not ready yet: %s", job.namespace, job.name, err)
            return Outcome(requeue_after=WAIT_SECONDS)
        fresh = self.calls.listed(job, status.restart_attempt)
        launch = launch_record(epoch, status.restart_attempt, fresh, self.config.render, job.uid)
        port = rendezvous_port(epoch, self.config.render, job.uid)
        started = Event.of(EventReason.TRAINING_STARTED, (
            f"started training epoch {epoch} on {len(pods)} workers (rendezvous "
            f"{pods[0].ip}:{port})"))
        writer.set(Launched(launch))
        return Outcome(events=[started, *([note] if note else [])])

    def _resume(self, job: JobView, snap: Snapshot, spec: JobSpec, status: JobStatus,
                writer: StatusWriter) -> Outcome:
        """Training ran before the job was suspended, and the pods took their memory with
        them: every sidecar restores the newest step committed to S3, then the launchers
        start from it."""
        record = status.recovery
        launched = status.launch.epoch if status.launch is not None else 0
        if record is None or record.kind != RESUME or record.epoch <= launched:
            try:
                steps = list(self.calls.committed_steps(job, spec.persistence))
            except S3Unreadable as err:  # starting over would throw the saved steps away
                return Outcome(requeue_after=S3_RETRY_SECONDS, events=[Event.of(
                    EventReason.RESUME_WAITING_FOR_S3, "cannot list the committed steps to "
                    f"resume from; retrying in {S3_RETRY_SECONDS:.0f}s: {err}")])
            if not steps:
                why = ("persistence is not configured" if spec.persistence is None
                       else "S3 lists no committed step")
                return self._start(job, snap, status, writer, Event.of(
                    EventReason.RESUMED_WITHOUT_CHECKPOINT,
                    f"resumed after the suspend from step 0: {why}"))
            record = self._begin_resume(spec, status, launched, max(steps), writer)
        try:
            if record.phase is RecoveryPhase.FETCHING:
                self.restorer.fetch(job, spec, status, record)
                record = record.at(RecoveryPhase.RESTARTING, self._clock().timestamp())
                writer.ahead(RecoveryAt(record))
            return self.restorer.restart(job, spec, status, record, writer)
        except SidecarError as err:
            log.info("resume of %s/%s waits for a sidecar: %s", job.namespace, job.name, err)
        except RecoveryWait as wait:
            log.info("resume of %s/%s waits: %s", job.namespace, job.name, wait)
        return Outcome(requeue_after=WAIT_SECONDS)

    def _begin_resume(self, spec: JobSpec, status: JobStatus, launched: int, version: int,
                      writer: StatusWriter) -> RecoveryRecord:
        now = self._clock()
        plan = RecoveryPlan(
            version, MODE_S3, dict.fromkeys(range(spec.num_nodes), RankSource("s3")), (), {},
            f"the job was resumed: step {version} is the newest committed to S3")
        record = RecoveryRecord(
            epoch=launched + 1, phase=RecoveryPhase.FETCHING, kind=RESUME,
            cause="the job was suspended (its pods and their memory were deleted)",
            detected_at=api_time(now), started_at=api_time(now), started_unix=now.timestamp(),
            marks={"planning": 0.0, "replacing": 0.0},
            plan=PlanRecord.from_plan(plan, status.checkpoint.in_memory_step),
        )
        writer.ahead(RecoveryAt(record))  # recorded before anything is restored
        return record
