"""The pure reconcile step: observed state in, actions, status and events out."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta

from gemini.domain.recovery import FailureKind
from gemini_operator.calls.worker_calls import launch_record
from gemini_operator.core import naming
from gemini_operator.core.actions import (
    CreatePods,
    CreateSecret,
    CreateService,
    DeleteJob,
    DeletePods,
    DeliverPlacement,
    Recover,
    StartTraining,
)
from gemini_operator.core.conditions import PLACEMENT_DELIVERED, SIDECARS_UNREACHABLE, upsert
from gemini_operator.core.decide import decide
from gemini_operator.core.observed import ContainerExit, NodeView, PodView
from gemini_operator.core.queueing import WorkloadView
from gemini_operator.core.status import JobStatus, status_patch
from gemini_operator.core.types import JobView, Observed, ReconcileConfig
from tests.unit.operator.builders import make_job

NOW = datetime(2026, 11, 29, 18, 0, 0, tzinfo=UTC)
CONFIG = ReconcileConfig(default_sidecar_image="gemini:side")
ZONES = ["a", "a", "b", "b"]
NODES = {f"n{i}": NodeView(f"n{i}", True, zone=ZONES[i]) for i in range(4)}


class Harness:
    """A job plus the cluster around it; `step()` reconciles and keeps the new status."""

    def __init__(self, builder=None):
        self.job = (builder or make_job()).with_uid("uid-1").obj()
        self.job["metadata"]["generation"] = 1
        self.pods: dict[int, PodView] = {}
        self.nodes = dict(NODES)
        self.has_children = False
        self.now = NOW
        self.pending: frozenset[int] = frozenset()
        self.exits: dict[int, int] = {}
        self.parked: dict[int, str] = {}
        self.workload: WorkloadView | None = None  # a queued job's Kueue Workload

    def step(self):
        observed = Observed(
            job=JobView.from_object(self.job), pods=dict(self.pods), nodes=self.nodes,
            has_service=self.has_children, has_secret=self.has_children, now=self.now,
            has_network_policy=self.has_children,
            pending_creates=self.pending, process_exits=self.exits, parked=self.parked,
            progress=getattr(self, "progress", None),
            workload=self.workload,
        )
        decision = decide(observed, CONFIG)
        self.previous_status = self.job.get("status")
        self.job["status"] = decision.status.to_dict()
        return decision

    def run_pods(self, phase="Running", ready=True, attempt=None, **kw):
        attempt = self.status().get("restartAttempt", 0) if attempt is None else attempt
        self.has_children = True
        for rank in range(self.job["spec"]["numNodes"]):
            self.pods[rank] = PodView(
                naming.worker_pod_name("train", rank), rank, attempt, f"u{rank}", phase,
                node_name=f"n{rank}", ready=ready, ip=f"10.0.0.{rank}", **kw)

    def status(self):
        return self.job.get("status") or {}

    def deliver(self, reason=PLACEMENT_DELIVERED, **values):
        """What the executor records after POSTing the placement to the sidecars."""
        values = values or {"ranks": self.job["spec"]["numNodes"]}
        status = JobStatus.from_dict(self.status())
        new = reason.condition("2026-11-29T18:00:01Z", 1, **values)
        self.job["status"] = status.with_changes(
            conditions=upsert(status.conditions, new)).to_dict()

    def condition(self, kind):
        return next((c for c in self.status().get("conditions", []) if c["type"] == kind), None)


def _of(decision, kind):
    return [a for a in decision.actions if isinstance(a, kind)]


def test_a_new_job_gets_its_secret_service_and_one_pod_per_rank():
    h = Harness()
    d = h.step()
    assert _of(d, CreateSecret) and _of(d, CreateService)
    (create,) = _of(d, CreatePods)
    assert [p["metadata"]["name"] for p in create.manifests] == [
        f"train-worker-{r}" for r in range(4)]
    assert h.condition("Created")["status"] == "True"
    assert h.status()["startTime"] == "2026-11-29T18:00:00Z"
    assert {"CreatedWorkers", "ChildrenCreated"} <= {e.reason for e in d.events}


def test_pods_being_created_are_not_mistaken_for_deleted_ones():
    h = Harness()
    h.step()
    h.has_children, h.pending = True, frozenset(range(4))
    d = h.step()
    assert not _of(d, Recover) and not _of(d, CreatePods)
    assert h.condition("Running")["reason"] == "WorkersStarting"


def test_ready_workers_make_the_job_running_with_a_domain_aware_placement():
    h = Harness()
    h.step()
    h.run_pods()
    d = h.step()
    assert h.condition("Running")["status"] == "True"
    assert h.status()["state"] == "Running"
    assert h.status()["workers"]["ready"] == 4
    placement = h.status()["placement"]
    assert placement["strategy"] == "domain-aware"
    for group in placement["groups"]:  # each pair of holders spans both zones
        assert {ZONES[r] for r in group} == {"a", "b"}
    assert placement["nodes"] == {str(r): f"n{r}" for r in range(4)}
    assert _of(d, DeliverPlacement)


def training_harness(**pod_fields: object) -> Harness:
    """A job whose workers run, have their placement and started training (epoch 1)."""
    h = Harness()
    h.step()
    h.run_pods(**pod_fields)
    h.step()
    h.deliver()
    h.step()
    h.job["status"]["launch"] = launch_record(1, 0, h.pods, CONFIG.render).to_dict()
    h.step()
    return h


def test_workers_finishing_one_by_one_keep_the_job_running_until_all_succeeded():
    h = training_harness()
    for rank in (0, 1):
        h.pods[rank] = replace(h.pods[rank], phase="Succeeded", ready=False)
    h.step()
    assert h.status()["state"] == "Running"
    running = h.condition("Running")
    assert (running["status"], running["reason"]) == ("True", "WorkersFinishing")
    assert "2 of 4 workers finished" in running["message"]
    for rank in (2, 3):
        h.pods[rank] = replace(h.pods[rank], phase="Succeeded", ready=False)
    h.step()
    assert h.status()["state"] == "Succeeded"
    # and Complete, as a batch/v1 Job says it (kubectl wait --for=condition=Complete)
    assert h.condition("Complete")["status"] == "True" == h.condition("Succeeded")["status"]


def test_trainers_done_while_their_sidecars_stop_keep_the_job_running():
    # Every trainer ended at once; the pods stay Running until their sidecars stop. The job
    # showed "Created" (Running False, "0 of 4 workers are ready") meanwhile.
    h = training_harness()
    for rank in h.pods:
        h.pods[rank] = replace(h.pods[rank], ready=False,
                               trainer_exit=ContainerExit(0, "Completed"))
    h.step()
    assert h.status()["state"] == "Running"
    running = h.condition("Running")
    assert (running["status"], running["reason"]) == ("True", "WorkersFinishing")
    assert "4 of 4 workers finished" in running["message"]


def test_reconciling_an_unchanged_job_writes_nothing_and_says_nothing():
    h = Harness()
    h.step()
    h.run_pods()
    assert _of(h.step(), DeliverPlacement)
    h.deliver()
    assert _of(h.step(), StartTraining)
    h.job["status"]["launch"] = launch_record(1, 0, h.pods, CONFIG.render).to_dict()
    h.now += timedelta(seconds=5)
    d = h.step()
    assert status_patch(h.previous_status, d.status.to_dict()) is None
    assert d.events == () and d.actions == ()


def test_mixed_placement_is_rendered_into_the_sidecar_env_up_front():
    h = Harness(make_job().set("checkpoint.placement", "Mixed"))
    (create,) = _of(h.step(), CreatePods)
    sidecar = create.manifests[1]["spec"]["initContainers"][0]
    env = {e["name"]: e.get("value") for e in sidecar["env"]}
    assert env["GEMINI_SEND_TO"] == "0" and env["GEMINI_HOLD_RANKS"] == "0"
    assert env["GEMINI_PEERS"].startswith("0=train-worker-0.train.default.svc")


def test_all_workers_succeeding_completes_the_job():
    h = Harness(make_job().set("ttlSecondsAfterFinished", 60))
    h.step()
    h.run_pods(phase="Succeeded", ready=False)
    d = h.step()
    assert h.status()["state"] == "Succeeded"
    assert h.condition("Running")["reason"] == "JobFinished"
    assert h.status()["completionTime"] == "2026-11-29T18:00:00Z"
    assert d.requeue_after == 60


def test_ttl_after_finishing_deletes_the_job():
    h = Harness(make_job().set("ttlSecondsAfterFinished", 60))
    h.step()
    h.run_pods(phase="Succeeded", ready=False)
    h.step()
    h.now += timedelta(seconds=30)
    assert h.step().requeue_after == 30
    h.now += timedelta(seconds=30)
    assert _of(h.step(), DeleteJob)


def test_a_failed_pod_starts_a_counted_hardware_recovery():
    h = Harness()
    h.step()
    h.run_pods()
    h.step()
    h.pods[2] = PodView("train-worker-2", 2, 0, "u2", "Failed", "n2",
                        trainer_exit=ContainerExit(3, "Error"))
    d = h.step()
    (recover,) = _of(d, Recover)
    assert recover.kind is FailureKind.HARDWARE and [f.rank for f in recover.failures] == [2]
    assert h.status()["state"] == "Recovering" and h.status()["restarts"] == 1
    message = h.condition("Recovering")["message"]
    assert "rank 2: the trainer container exited with code 3" in message
    assert any(e.reason == "RecoveryNeeded" and e.warning for e in d.events)
    # The next reconcile continues the same recovery and does not count it again.
    d = h.step()
    assert _of(d, Recover) and h.status()["restarts"] == 1


def test_a_software_failure_restarts_in_place():
    h = Harness()
    h.step()
    h.run_pods()
    h.step()
    h.exits = {1: 1}
    (recover,) = _of(h.step(), Recover)
    assert recover.kind is FailureKind.SOFTWARE


def test_a_parked_training_process_is_a_software_failure_with_its_error():
    h = Harness()
    h.step()
    h.run_pods()
    h.step()
    h.parked = {0: "Traceback ...\nValueError: loss is NaN", 2: "RuntimeError: gloo closed"}
    (recover,) = _of(h.step(), Recover)
    assert recover.kind is FailureKind.SOFTWARE and [f.rank for f in recover.failures] == [0, 2]
    assert "waits for an in-process restart" in recover.failures[0].detail
    assert recover.failures[0].log_tail.endswith("ValueError: loss is NaN")
    assert h.status()["restarts"] == 1
    d = h.step()  # still parked until the recovery's restart reaches them: not counted again
    assert _of(d, Recover) and h.status()["restarts"] == 1


def test_ranks_parked_by_another_ranks_failure_are_not_failures_of_their_own():
    h = Harness()
    h.step()
    h.run_pods()
    h.step()
    h.exits, h.parked = {1: 137}, {0: "RuntimeError: Connection closed by peer"}
    (recover,) = _of(h.step(), Recover)
    assert [f.rank for f in recover.failures] == [1]


def test_a_lost_node_is_a_hardware_failure_of_its_rank():
    h = Harness()
    h.step()
    h.run_pods()
    h.step()
    h.nodes["n3"] = NodeView("n3", False)
    (recover,) = _of(h.step(), Recover)
    assert [f.reason.value for f in recover.failures] == ["NodeLost"]


def test_no_restarts_left_fails_the_job_and_stops_its_pods():
    h = Harness(make_job().set("failurePolicy.maxRestarts", 0))
    h.step()
    h.run_pods()
    h.step()
    del h.pods[0]
    d = h.step()
    assert h.status()["state"] == "Failed"
    assert h.condition("Failed")["reason"] == "MaxRestartsExceeded"
    (delete,) = _of(d, DeletePods)
    assert delete.names == ("train-worker-1", "train-worker-2", "train-worker-3")
    assert not _of(d, Recover)


def test_a_fail_job_rule_fails_the_job_at_once():
    rules = [{"name": "oom", "action": "FailJob", "onPodFailureReasons": ["OOMKilled"]}]
    h = Harness(make_job().set("failurePolicy.rules", rules))
    h.step()
    h.run_pods()
    h.step()
    h.pods[1] = PodView("train-worker-1", 1, 0, "u1", "Failed", "n1",
                        trainer_exit=ContainerExit(137, "OOMKilled"))
    h.step()
    assert h.condition("Failed")["reason"] == "FailurePolicyRuleMatched"
    assert "rule oom" in h.condition("Failed")["message"]


def test_suspend_deletes_the_pods_and_resume_recreates_them_for_a_new_attempt():
    h = Harness()
    h.step()
    h.run_pods()
    h.step()
    h.job["spec"]["suspend"] = True
    d = h.step()
    assert h.status()["state"] == "Suspended"
    assert len(_of(d, DeletePods)[0].names) == 4
    assert h.condition("Created")["status"] == "False"
    assert "startTime" not in h.status()
    h.pods.clear()
    h.job["spec"]["suspend"] = False
    (create,) = _of(h.step(), CreatePods)
    assert h.status()["restartAttempt"] == 1
    attempts = {p["metadata"]["labels"][naming.LABEL_RESTART_ATTEMPT] for p in create.manifests}
    assert attempts == {"1"}
    assert h.condition("Suspended")["reason"] == "JobResumed"


def test_resume_waits_for_old_pods_to_go_before_reusing_their_names():
    h = Harness()
    h.step()
    h.run_pods()
    h.job["spec"]["suspend"] = True
    h.step()
    h.job["spec"]["suspend"] = False
    d = h.step()
    assert not _of(d, CreatePods)
    assert len(_of(d, DeletePods)[0].names) == 4
    assert h.condition("Created")["status"] == "False"


def test_the_active_deadline_fails_the_job():
    h = Harness(make_job().set("activeDeadlineSeconds", 100))
    h.step()
    h.run_pods()
    assert h.step().requeue_after == 100
    h.now += timedelta(seconds=100)
    h.step()
    assert h.condition("Failed")["reason"] == "DeadlineExceeded"


def test_a_job_that_ends_during_a_recovery_is_no_longer_recovering():
    h = Harness(make_job().set("activeDeadlineSeconds", 100))
    h.step()
    h.run_pods()
    h.step()
    del h.pods[1]
    assert _of(h.step(), Recover)
    assert h.condition("Recovering")["status"] == "True"
    h.now += timedelta(seconds=100)
    h.step()
    assert h.status()["state"] == "Failed"
    assert h.condition("Failed")["reason"] == "DeadlineExceeded"
    recovering = h.condition("Recovering")
    assert (recovering["status"], recovering["reason"]) == ("False", "RecoveryAbandoned")
    assert "recovery" not in h.status()


def test_an_invalid_spec_fails_once_with_the_fix_and_creates_nothing():
    h = Harness(make_job().set("checkpoint.memoryBudgetPerNode", "-1Gi"))
    d = h.step()
    assert not d.actions
    failed = h.condition("Failed")
    assert failed["reason"] == "InvalidSpec" and "memoryBudgetPerNode" in failed["message"]
    assert any(e.reason == "InvalidSpec" and e.warning for e in d.events)
    assert h.step().events == ()


def test_conditions_carry_the_observed_generation_and_keep_transition_times():
    h = Harness()
    h.step()
    h.run_pods(ready=False)
    h.step()
    first = h.condition("Running")["lastTransitionTime"]
    h.now += timedelta(seconds=10)
    h.pods[0] = PodView("train-worker-0", 0, 0, "u0", "Running", "n0", ready=True)
    h.step()
    running = h.condition("Running")
    assert running["message"] == "1 of 4 workers are ready"
    assert running["lastTransitionTime"] == first and running["observedGeneration"] == 1


def test_a_failing_job_stops_running_pods_but_keeps_finished_ones_for_their_logs():
    h = Harness(make_job().set("failurePolicy.maxRestarts", 0))
    h.step()
    h.run_pods()
    h.step()
    h.pods[0] = PodView("train-worker-0", 0, 0, "u0", "Failed", "n0",
                        trainer_exit=ContainerExit(1, "Error"))
    h.pods[3] = PodView("train-worker-3", 3, 0, "u3", "Succeeded", "n3")
    (delete,) = _of(h.step(), DeletePods)
    assert delete.names == ("train-worker-1", "train-worker-2")


def test_a_job_suspended_from_the_start_begins_with_attempt_zero():
    h = Harness(make_job().set("suspend", True))
    assert not _of(h.step(), CreatePods)
    assert h.status()["state"] == "Suspended"
    h.job["spec"]["suspend"] = False
    (create,) = _of(h.step(), CreatePods)
    assert h.status()["restartAttempt"] == 0 and len(create.manifests) == 4


def test_placement_waits_until_every_worker_is_scheduled():
    h = Harness()
    h.step()
    h.run_pods(phase="Pending", ready=False)
    h.pods[2] = PodView("train-worker-2", 2, 0, "u2", "Pending")  # not scheduled yet
    d = h.step()
    assert "placement" not in h.status() and not _of(d, DeliverPlacement)


def test_placement_is_published_when_scheduled_and_delivered_once_every_worker_runs():
    h = Harness()
    h.step()
    h.run_pods(phase="Pending", ready=False)
    d = h.step()
    assert h.status()["placement"]["nodes"] == {str(r): f"n{r}" for r in range(4)}
    assert h.condition("PlacementDelivered")["reason"] == "PlacementPending"
    assert not _of(d, DeliverPlacement) and not _of(d, StartTraining)
    h.run_pods()
    (deliver,) = _of(h.step(), DeliverPlacement)
    assert deliver.placement == h.status()["placement"]


def test_training_starts_only_after_every_sidecar_took_the_placement():
    h = Harness()
    h.step()
    h.run_pods()
    h.step()
    h.deliver(SIDECARS_UNREACHABLE, failed=1, ranks=4, detail="rank 3: refused")
    d = h.step()
    assert _of(d, DeliverPlacement) and not _of(d, StartTraining)  # delivered again
    assert h.condition("PlacementDelivered")["reason"] == "SidecarsUnreachable"
    h.deliver()
    d = h.step()
    assert _of(d, StartTraining) and not _of(d, DeliverPlacement)


def test_a_rank_on_another_node_gets_a_new_placement_to_deliver():
    h = Harness()
    h.step()
    h.run_pods()
    h.step()
    h.deliver()
    h.pods[1] = PodView("train-worker-1", 1, 0, "u1b", "Running", node_name="n9", ready=True,
                        ip="10.0.0.9")
    h.nodes["n9"] = NodeView("n9", True, zone="b")
    d = h.step()
    assert h.status()["placement"]["nodes"]["1"] == "n9"
    assert h.condition("PlacementDelivered")["status"] == "False"
    assert _of(d, DeliverPlacement)


def test_pods_left_by_an_earlier_job_of_the_same_name_are_waited_for():
    h = Harness()
    observed = Observed(job=JobView.from_object(h.job), pods={}, nodes=h.nodes,
                        has_service=True, has_secret=True, now=NOW,
                        foreign_ranks=frozenset({1, 2}))
    d = decide(observed, CONFIG)
    (create,) = _of(d, CreatePods)
    assert [p["metadata"]["name"] for p in create.manifests] == ["train-worker-0",
                                                                 "train-worker-3"]
    assert d.status.to_dict()["state"] == "Created"
    assert all(c.type != "Created" for c in d.status.conditions)


def test_a_worker_pod_the_api_server_refused_fails_the_job_naming_the_field():
    h = Harness()
    h.run_pods()
    refusal = ('could not create Pod default/train-worker-0: Pod "train-worker-0" is invalid: '
               'spec.tolerations[0].effect: Unsupported value: "Sometimes"')
    observed = Observed(job=JobView.from_object(h.job), pods=dict(h.pods), nodes=h.nodes,
                        has_service=True, has_secret=True, now=NOW, pod_refused=refusal)
    d = decide(observed, CONFIG)
    failed = next(c for c in d.status.conditions if c.type == "Failed")
    assert failed.status == "True" and failed.reason == "InvalidSpec"
    assert "spec.template.spec: the API server refused the worker pod" in failed.message
    assert "spec.tolerations[0].effect" in failed.message
    assert _of(d, DeletePods), "the pods created before the refusal are deleted"
