"""Software failures seen in the pod watch, the start protocol, and the recovery documents."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta

from gemini.control.inventory import Inventory, LocalCopy, ReplicaCopy
from gemini.control.launcher import Progress as Heartbeat
from gemini.domain.placement import mixed_placement
from gemini.domain.recovery import FailureKind, plan_recovery
from gemini_operator.calls.poller import complete_in_memory, progress_of
from gemini_operator.calls.worker_calls import inventory_copies, launch_record, rendezvous
from gemini_operator.core.actions import Recover, StartTraining
from gemini_operator.core.decide_failures import trainer_exits
from gemini_operator.core.failures import Progress
from gemini_operator.core.observed import ContainerExit, PodView, pod_view
from gemini_operator.core.records import PlanRecord, RecoveryRecord
from gemini_operator.core.render import RenderConfig
from gemini_operator.core.spec import parse_spec
from gemini_operator.core.status import JobStatus
from gemini_operator.steps.restore import breakdown
from tests.unit.operator.builders import inventory, make_job
from tests.unit.operator.status_notes import NotedStatus
from tests.unit.operator.test_decide import CONFIG, Harness, _of

SPEC = parse_spec(make_job().obj()["spec"], "gemini:side")
PODS = {r: PodView(f"train-worker-{r}", r, 0, f"u{r}", "Running", node_name=f"n{r}",
                   ready=True, ip=f"10.0.0.{r}") for r in range(4)}


def test_a_trainer_restart_after_the_launch_is_a_software_failure_with_its_exit_code() -> None:
    launch = launch_record(1, 0, PODS, RenderConfig())
    assert trainer_exits(PODS, launch, 0) == {}
    crashed = dict(PODS)
    crashed[2] = replace(PODS[2], trainer_restarts=1, trainer_last_exit=ContainerExit(137, "Error"))
    assert trainer_exits(crashed, launch, 0) == {2: 137}
    assert trainer_exits(crashed, launch, 1) == {}  # another attempt's launch record
    assert trainer_exits(crashed, None, 0) == {}  # training not started yet


def test_a_replacement_pod_starts_from_a_zero_baseline() -> None:
    launch = launch_record(1, 0, {**PODS, 1: replace(PODS[1], trainer_restarts=3)},
                           RenderConfig())
    fresh = {**PODS, 1: replace(PODS[1], uid="new")}
    assert trainer_exits(fresh, launch, 0) == {}
    fresh[1] = replace(fresh[1], trainer_restarts=1)
    assert trainer_exits(fresh, launch, 0) == {1: 1}


def test_training_starts_once_every_worker_runs_then_a_crash_restarts_in_place() -> None:
    h = Harness()
    h.step()
    h.run_pods(phase="Pending", ready=False)
    assert not _of(h.step(), StartTraining)
    h.run_pods()
    assert not _of(h.step(), StartTraining)  # the placement goes to the sidecars first
    h.deliver()
    assert _of(h.step(), StartTraining)
    h.job["status"]["launch"] = launch_record(1, 0, h.pods, CONFIG.render).to_dict()
    assert not _of(h.step(), StartTraining)
    h.pods[3] = replace(h.pods[3], trainer_restarts=1,
                        trainer_last_exit=ContainerExit(1, "Error"))
    d = h.step()
    (recover,) = _of(d, Recover)
    assert recover.kind is FailureKind.SOFTWARE and [f.rank for f in recover.failures] == [3]
    assert h.condition("Recovering")["status"] == "True"
    assert h.status()["restarts"] == 1
    assert all(type(a).__name__ not in ("CreatePods", "DeletePods") for a in d.actions)


def test_the_pod_view_reads_trainer_restarts_and_last_exit() -> None:
    pod = {"metadata": {"name": "p", "labels": {"gemini.io/rank": "0"}},
           "status": {"phase": "Running", "containerStatuses": [{
               "name": "trainer", "restartCount": 2,
               "lastState": {"terminated": {"exitCode": 137, "reason": "Error"}},
               "state": {"running": {}}}]}}
    view = pod_view(pod)
    assert view is not None
    assert view.trainer_restarts == 2 and view.trainer_last_exit == ContainerExit(137, "Error")


def test_each_epoch_meets_at_rank_zeros_ip_on_its_own_port() -> None:
    config = RenderConfig()
    one, two = rendezvous(PODS, 1, config), rendezvous(PODS, 2, config)
    assert one["MASTER_ADDR"] == "10.0.0.0" and one["MASTER_PORT"] != two["MASTER_PORT"]
    assert rendezvous(PODS, 1001, config)["MASTER_PORT"] == one["MASTER_PORT"]


def test_inventories_become_a_plan_document() -> None:
    placement = mixed_placement(4, 2)
    inventories = {
        r: replace(inventory(r),
                   local=tuple(LocalCopy(r, v, True, 0, 7 + r) for v in (10, 12)),
                   replicas=tuple(ReplicaCopy(p, 12, True, 0, 0, 7 + p)
                                  for p in placement.receives_from(r)))
        for r in (0, 2, 3)
    }
    copies = inventory_copies(inventories)
    plan = plan_recovery(2, placement, [1], [1], copies, [])
    record = PlanRecord.from_plan(plan, 12)
    doc = record.to_dict()
    assert doc["version"] == 12 and doc["replaceRanks"] == [1]
    assert doc["sources"]["1"]["kind"] == "peer" and doc["sources"]["0"]["kind"] == "local"
    assert record.source_word == "Peers"
    assert PlanRecord.from_dict(doc) == record
    assert PlanRecord.from_dict({"mode": "s3"}).source_word == "S3"
    local = {"mode": "memory", "sources": {"0": {"kind": "local"}}}
    assert PlanRecord.from_dict(local).source_word == "Local"


def test_breakdown_turns_cumulative_marks_into_phase_seconds() -> None:
    marks = {"planning": 0.5, "replacing": 4.0, "fetching": 5.0, "restarting": 5.5}
    assert breakdown(marks) == {"planning": 0.5, "replacing": 3.5, "fetching": 1.0,
                                "restarting": 0.5}


def test_a_recovery_planned_again_reports_the_superseded_time_apart_from_its_phases() -> None:
    from gemini_operator.calls.tokens import JobTokens
    from gemini_operator.calls.worker_calls import WorkerCalls
    from gemini_operator.core.failures import FailureReason, RankFailure
    from gemini_operator.core.types import JobView
    from gemini_operator.steps.recovery import RecoveryExecutor

    # Rank 1 lost 4.6 s into a recovery that was replacing rank 0: the new plan keeps the
    # epoch and start, its phases are timed afresh, and the 4.6 s are reported apart.
    first = RecoveryRecord.from_dict(RECOVERY_DOC)
    now = datetime.fromtimestamp(first.started_unix + 4.6, UTC)
    notes = NotedStatus()
    written = notes.written
    calls = WorkerCalls(None, CONFIG.render, JobTokens(None, None))  # type: ignore[arg-type]
    executor = RecoveryExecutor(None, CONFIG, calls, lambda: now)  # type: ignore[arg-type]
    lost = RankFailure(2, FailureKind.HARDWARE, FailureReason.NODE_LOST, None, "node gone")
    job = JobView("j", "ns", "uid", 1, {})
    again = executor._begin(job, Recover(FailureKind.HARDWARE, (lost,), SPEC), 2, notes, first)
    assert (again.epoch, again.started_unix, again.lost_ranks) == (3, first.started_unix, (1, 2))
    assert again.marks == {"superseded": 4.6} and written == [{"recovery": again.to_dict()}]
    marks = {**again.marks, "planning": 5.0, "replacing": 8.0, "fetching": 8.25,
             "restarting": 8.5}
    assert breakdown(marks) == {"superseded": 4.6, "planning": 0.4, "replacing": 3.0,
                                "fetching": 0.25, "restarting": 0.25}


def test_in_memory_step_is_the_newest_version_complete_on_every_rank() -> None:
    def inv(*versions: tuple[int, bool]) -> Inventory:
        return inventory(0, versions)

    inventories = {0: inv((4, True), (5, True)), 1: inv((4, True), (5, False))}
    assert complete_in_memory(inventories, [0, 1]) == 4
    assert complete_in_memory({0: inv((5, True)), 1: inv()}, [0, 1]) is None
    assert complete_in_memory(inventories, [0, 1, 2]) is None  # rank 2 did not answer


def test_progress_keeps_its_start_while_the_step_does_not_move() -> None:
    now = datetime(2026, 11, 29, 18, 0, tzinfo=UTC)
    statuses = {0: Heartbeat(7, 0.0, 2.0), 1: Heartbeat(6, 0.0, 1.0)}
    first = progress_of(statuses, now, None)
    assert first == Progress(7, now - timedelta(seconds=2))
    assert progress_of(statuses, now + timedelta(seconds=60), first) == first
    moved = progress_of({0: Heartbeat(8, 0.0, 0.5)}, now, first)
    assert moved is not None and moved.step == 8
    assert progress_of({0: None}, now, first) == first


def test_no_progress_for_the_hang_timeout_restarts_every_rank_in_place() -> None:
    h = Harness(make_job().set("failurePolicy.hangTimeoutSeconds", 60))
    h.step()
    h.run_pods()
    h.step()
    h.job["status"]["launch"] = launch_record(1, 0, h.pods, CONFIG.render).to_dict()
    since = h.now
    h.progress = Progress(9, since)
    h.now = since + timedelta(seconds=30)
    assert not _of(h.step(), Recover)
    h.now = since + timedelta(seconds=61)
    (recover,) = _of(h.step(), Recover)
    assert recover.kind is FailureKind.HANG and len(recover.failures) == 4


def test_a_node_lost_after_planning_makes_the_recovery_plan_again() -> None:
    from gemini_operator.core.failures import FailureReason, RankFailure
    from gemini_operator.steps.recovery import newly_lost

    crash = RankFailure(0, FailureKind.SOFTWARE, FailureReason.ERROR, 1, "exited")
    lost = RankFailure(1, FailureKind.HARDWARE, FailureReason.NODE_LOST, None, "node gone")
    planned_soft = RecoveryRecord.from_dict({"plan": {"lostRanks": []}})
    planned_hard = RecoveryRecord.from_dict({"plan": {"lostRanks": [1]}})
    assert not newly_lost(Recover(FailureKind.SOFTWARE, (crash,), SPEC), planned_soft)
    assert newly_lost(Recover(FailureKind.HARDWARE, (crash, lost), SPEC), planned_soft)
    assert not newly_lost(Recover(FailureKind.HARDWARE, (lost,), SPEC), planned_hard)


def test_a_replan_for_newly_lost_ranks_is_confirmed_with_the_api_first() -> None:
    from gemini_operator.core.actions import Decision
    from gemini_operator.core.failures import FailureReason, RankFailure
    from gemini_operator.core.status import JobStatus
    from gemini_operator.runtime.reconciler import _replans

    lost = RankFailure(1, FailureKind.HARDWARE, FailureReason.NODE_LOST, None, "node gone")
    action = Recover(FailureKind.HARDWARE, (lost,), SPEC)
    planned = JobStatus(recovery=RecoveryRecord.from_dict(
        {"epoch": 2, "phase": "Fetching", "plan": {"lostRanks": []}}))
    assert _replans(Decision(planned, (action,)))
    done = JobStatus(recovery=RecoveryRecord.from_dict(
        {"epoch": 2, "phase": "Fetching", "plan": {"lostRanks": [1]}}))
    assert not _replans(Decision(done, (action,)))
    assert not _replans(Decision(JobStatus(), (action,)))  # a new recovery: confirmed anyway


# status.recovery and status.launch as the operator wrote them before they were typed: the
# records must read them and write back exactly the same JSON (the CRD, the kubectl plugin
# and a restarted operator read it).
RECOVERY_DOC = {
    "epoch": 3, "phase": "Fetching", "kind": "hardware", "cause": "rank 1's node was lost",
    "failedRanks": [1], "detectedAt": "2026-11-29T18:00:00Z",
    "startedAt": "2026-11-29T18:00:00Z", "startedUnix": 1795975200.25,
    "marks": {"planning": 0.4, "replacing": 6.1},
    "plan": {"version": 12, "mode": "memory", "reason": "restore version 12 from memory",
             "replaceRanks": [1], "sources": {"0": {"kind": "local", "holder": 0},
                                              "1": {"kind": "peer", "holder": 0}},
             "refetch": {"1": [0]}, "newestSeen": 13, "lostRanks": [1]},
}
LAUNCH_DOC = {"epoch": 2, "restartAttempt": 0, "masterAddr": "10.0.0.0", "masterPort": 29502,
              "trainerRestarts": {"0": 0, "1": 2}, "podUIDs": {"0": "u0", "1": "u1"}}


def test_the_typed_records_write_back_exactly_the_json_they_read() -> None:
    from gemini_operator.core.records import LaunchRecord, RecoveryPhase

    record = RecoveryRecord.from_dict(RECOVERY_DOC)
    assert record.phase is RecoveryPhase.FETCHING and record.lost_ranks == (1,)
    assert record.plan is not None and record.plan.peer_sources() == {1: 0}
    assert record.to_dict() == RECOVERY_DOC
    planning = {**RECOVERY_DOC, "phase": "Planning", "marks": {}, "plan": {"lostRanks": [1]}}
    assert RecoveryRecord.from_dict(planning).plan is None
    assert RecoveryRecord.from_dict(planning).to_dict() == planning
    assert LaunchRecord.from_dict(LAUNCH_DOC).to_dict() == LAUNCH_DOC
    status = {"launch": LAUNCH_DOC, "recovery": RECOVERY_DOC}
    assert {k: v for k, v in JobStatus.from_dict(status).to_dict().items()
            if k in status} == status


def test_each_phase_is_marked_with_the_seconds_since_the_start() -> None:
    from gemini_operator.core.records import RecoveryPhase

    record = RecoveryRecord.from_dict(RECOVERY_DOC)
    moved = record.at(RecoveryPhase.RESTARTING, record.started_unix + 7.0)
    assert moved.phase is RecoveryPhase.RESTARTING and moved.plan == record.plan
    assert moved.marks == {"planning": 0.4, "replacing": 6.1, "fetching": 7.0}
