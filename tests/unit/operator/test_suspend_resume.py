"""Suspend saves the checkpoint in memory before the pods go; resume restores it from S3."""

from __future__ import annotations

from dataclasses import replace

from gemini_operator.calls.tokens import JobTokens
from gemini_operator.calls.worker_calls import WorkerCalls, launch_record
from gemini_operator.cluster.cache import Snapshot
from gemini_operator.core.actions import (
    DeletePods,
    DeliverPlacement,
    SaveBeforeSuspend,
    StartTraining,
)
from gemini_operator.core.outcome import S3Unreadable
from gemini_operator.core.records import RESUME, LaunchRecord
from gemini_operator.core.spec import Persistence, parse_spec
from gemini_operator.core.status import JobStatus
from gemini_operator.core.types import JobView
from gemini_operator.steps.start import S3_RETRY_SECONDS, TrainingStarter, resuming
from tests.unit.operator.builders import make_job
from tests.unit.operator.status_notes import NotedStatus
from tests.unit.operator.test_decide import CONFIG, Harness, _of


def _training() -> Harness:
    """A job whose four workers run and train (epoch 1 launched)."""
    h = Harness()
    h.step()
    h.run_pods()
    h.step()
    h.deliver()
    assert _of(h.step(), StartTraining)
    h.job["status"]["launch"] = launch_record(1, 0, h.pods, CONFIG.render).to_dict()
    assert not _of(h.step(), StartTraining)
    return h


def test_suspending_a_training_job_saves_its_memory_before_deleting_the_pods() -> None:
    h = _training()
    h.job["spec"]["suspend"] = True
    d = h.step()
    kinds = [type(a) for a in d.actions]
    assert SaveBeforeSuspend in kinds and DeletePods in kinds
    assert kinds.index(SaveBeforeSuspend) < kinds.index(DeletePods)
    for rank, pod in h.pods.items():  # the deletion is under way: nothing left to save
        h.pods[rank] = replace(pod, deleting=True)
    assert not _of(h.step(), SaveBeforeSuspend)


def test_a_job_suspended_before_training_started_has_nothing_to_save() -> None:
    h = Harness()
    h.step()
    h.run_pods()
    h.step()
    h.job["spec"]["suspend"] = True
    d = h.step()
    assert _of(d, DeletePods) and not _of(d, SaveBeforeSuspend)


def test_resume_places_the_new_pods_afresh_and_then_restores_instead_of_starting() -> None:
    h = _training()
    old_placement = h.status()["placement"]
    h.job["spec"]["suspend"] = True
    h.step()
    h.pods.clear()
    assert not resuming(JobStatus.from_dict(h.status()))
    h.job["spec"]["suspend"] = False
    h.step()
    assert h.status()["restartAttempt"] == 1 and "placement" not in h.status()
    assert resuming(JobStatus.from_dict(h.status()))  # training ran in attempt 0
    h.run_pods()  # the same nodes as before: the placement is still computed and delivered
    d = h.step()
    assert _of(d, DeliverPlacement) and not _of(d, StartTraining)
    assert h.status()["placement"]["restartAttempt"] == 1
    assert h.status()["placement"]["holders"] == old_placement["holders"]
    h.deliver()
    assert _of(h.step(), StartTraining)  # the executor restores from S3 (resuming)
    h.job["status"]["recovery"] = {"epoch": 2, "phase": "Fetching", "kind": RESUME}
    assert resuming(JobStatus.from_dict(h.status()))
    h.job["status"].pop("recovery")
    h.job["status"]["launch"] = launch_record(2, 1, h.pods, CONFIG.render).to_dict()
    assert not resuming(JobStatus.from_dict(h.status()))
    assert not _of(h.step(), StartTraining)


def test_suspending_during_a_recovery_ends_it_and_resume_restores_instead() -> None:
    h = _training()
    h.pods[1] = replace(h.pods[1], phase="Failed")
    h.step()
    assert h.condition("Recovering")["status"] == "True"
    h.job["status"]["recovery"] = {"epoch": 2, "phase": "Replacing", "kind": "hardware"}
    h.job["spec"]["suspend"] = True
    h.step()
    assert h.condition("Recovering")["reason"] == "RecoverySuspended"
    assert "recovery" not in h.status()
    assert resuming(JobStatus.from_dict(h.status())) is False  # same attempt until resumed


def test_a_resume_waits_for_an_unreadable_s3_instead_of_starting_over() -> None:
    def unreadable(job: JobView, persistence: Persistence | None) -> list[int]:
        raise S3Unreadable("s3://bucket/prefix: connection refused")

    notes = NotedStatus()
    written = notes.written
    calls = WorkerCalls(None, CONFIG.render, JobTokens(None, None), unreadable)  # type: ignore[arg-type]
    starter = TrainingStarter(None, CONFIG, calls)  # type: ignore[arg-type]
    job = JobView.from_object(make_job("train").obj())
    status = JobStatus(launch=LaunchRecord(epoch=3, restart_attempt=0), restart_attempt=1)
    assert resuming(status)
    action = StartTraining(parse_spec(job.spec, CONFIG.default_sidecar_image))
    outcome = starter.start_training(job, Snapshot({}, {}, {}), action, status, notes)
    assert outcome.requeue_after == S3_RETRY_SECONDS
    assert [e.reason for e in outcome.events] == ["ResumeWaitingForS3"]
    assert "connection refused" in outcome.events[0].message
    assert not notes.kept and not written  # nothing started, nothing recorded
