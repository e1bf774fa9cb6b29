"""The operator against the real API server, controller manager and scheduler (no nodes:
worker pods stay Pending, which is all these tests need)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from gemini import rank_detail
from gemini_local.watcher import Watcher
from gemini_operator.core import naming
from tests.fixtures.operator import OperatorThread, configmap_reader
from tests.unit.operator.builders import make_job

pytestmark = pytest.mark.cluster


def wait_for(predicate: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def sidecar_port(pod: Any) -> int:
    """The port of a worker pod's sidecar API, as the operator rendered it."""
    containers = [*(pod.spec.init_containers or []), *pod.spec.containers]
    return next(int(p.container_port) for c in containers for p in c.ports or []
                if p.name == "sidecar-api")


class Jobs:
    def __init__(self, api: client.ApiClient, namespace: str) -> None:
        self.custom, self.core = client.CustomObjectsApi(api), client.CoreV1Api(api)
        self.ns = namespace

    def create(self, body: dict[str, Any]) -> None:
        body["metadata"]["namespace"] = self.ns
        if body["spec"]["template"].get("command") == make_job().spec()["template"]["command"]:
            # When other tests of the session started nodes, the pods really run: keep busy.
            body["spec"]["template"]["command"] = ["python", "-c", "import time; time.sleep(600)"]
        self.custom.create_namespaced_custom_object(naming.GROUP, naming.VERSION, self.ns,
                                                    naming.PLURAL, body)

    def get(self, name: str) -> Any:
        try:
            return self.custom.get_namespaced_custom_object(
                naming.GROUP, naming.VERSION, self.ns, naming.PLURAL, name)
        except ApiException as err:
            if err.status == 404:
                return None
            raise

    def status(self, name: str) -> dict[str, Any]:
        """The job's full status: per-rank maps joined in from the ConfigMap it names (the
        session's operator keeps them there for every job, gemini.rank_detail)."""
        return rank_detail.resolve((self.get(name) or {}).get("status") or {},
                                   configmap_reader(self.core, self.ns))

    def patch(self, name: str, spec: dict[str, Any]) -> None:
        self.custom.patch_namespaced_custom_object(naming.GROUP, naming.VERSION, self.ns,
                                                   naming.PLURAL, name, {"spec": spec})

    def delete(self, name: str) -> None:
        self.custom.delete_namespaced_custom_object(naming.GROUP, naming.VERSION, self.ns,
                                                    naming.PLURAL, name)

    def condition(self, name: str, kind: str) -> Any:
        job = self.get(name) or {}
        return next((c for c in (job.get("status") or {}).get("conditions", [])
                     if c["type"] == kind), None)

    def state(self, name: str) -> str | None:
        return ((self.get(name) or {}).get("status") or {}).get("state")

    def pods(self, name: str) -> list[Any]:
        selector = f"{naming.LABEL_JOB}={name}"
        return list(self.core.list_namespaced_pod(self.ns, label_selector=selector).items)

    def events(self, name: str) -> list[Any]:
        return [e for e in self.core.list_namespaced_event(self.ns).items
                if e.involved_object.name == name and e.involved_object.kind == naming.KIND]


def _names(listing: Any) -> set[str]:
    return {item.metadata.name for item in listing.items}


@pytest.fixture
def jobs(kube_api: client.ApiClient, job_namespace: str, gemini_operator: OperatorThread) -> Jobs:
    return Jobs(kube_api, job_namespace)


def test_a_job_gets_its_children_owned_by_it_and_a_status(jobs: Jobs) -> None:
    jobs.create(make_job("train").with_nodes(3).obj())
    wait_for(lambda: len(jobs.pods("train")) == 3, 10, "three worker pods")
    created = wait_for(lambda: jobs.condition("train", "Created"), 10, "the Created condition")
    assert created["status"] == "True" and created["reason"] == "ChildrenCreated"
    job = jobs.get("train")
    assert job is not None
    assert job["status"]["state"] in ("Created", "Running")
    assert job["status"]["workers"]["total"] == 3
    assert job["status"]["observedGeneration"] == job["metadata"]["generation"]
    for pod in jobs.pods("train"):
        (owner,) = pod.metadata.owner_references
        assert (owner.kind, owner.uid, owner.controller) == ("GeminiJob", job["metadata"]["uid"],
                                                            True)
        assert pod.spec.init_containers[0].restart_policy == "Always"
    assert {p.metadata.name for p in jobs.pods("train")} == {f"train-worker-{r}" for r in range(3)}
    jobs.core.read_namespaced_service("train", jobs.ns)
    jobs.core.read_namespaced_secret("train-peer-auth", jobs.ns)
    reasons = {e.reason for e in wait_for(lambda: jobs.events("train"), 5, "events")}
    assert "ChildrenCreated" in reasons


def test_deleting_the_job_removes_every_child(jobs: Jobs) -> None:
    jobs.create(make_job("doomed").with_nodes(2).obj())
    wait_for(lambda: len(jobs.pods("doomed")) == 2, 10, "two worker pods")
    wait_for(lambda: jobs.condition("doomed", "Created"), 10, "the Created condition")
    jobs.delete("doomed")
    # The garbage collector learns a new CRD at its next discovery resync (every 30 s), so
    # right after the CRD is installed this can take that long.
    wait_for(lambda: not jobs.pods("doomed"), 60, "the garbage collector to delete the pods")
    wait_for(lambda: "doomed" not in _names(jobs.core.list_namespaced_service(jobs.ns)), 30,
             "the Service to go")
    wait_for(lambda: "doomed-peer-auth" not in _names(jobs.core.list_namespaced_secret(jobs.ns)),
             30, "the Secret to go")


def test_suspend_deletes_the_pods_and_resume_brings_them_back_as_a_new_attempt(jobs: Jobs) -> None:
    jobs.create(make_job("pausable").with_nodes(2).obj())
    wait_for(lambda: len(jobs.pods("pausable")) == 2, 10, "two worker pods")
    jobs.patch("pausable", {"suspend": True})
    wait_for(lambda: jobs.state("pausable") == "Suspended", 10, "state Suspended")
    wait_for(lambda: not jobs.pods("pausable"), 10, "the pods to be deleted")
    jobs.patch("pausable", {"suspend": False})
    pods = wait_for(lambda: (p := jobs.pods("pausable")) and len(p) == 2 and p, 10,
                    "two new worker pods")
    assert {p.metadata.labels[naming.LABEL_RESTART_ATTEMPT] for p in pods} == {"1"}
    # The status is written right after the pods are created: allow for the gap.
    wait_for(lambda: jobs.condition("pausable", "Suspended")["reason"] == "JobResumed", 5,
             "the Suspended condition to say JobResumed")


def test_a_spec_only_the_operator_can_judge_fails_with_a_warning_event(jobs: Jobs) -> None:
    # The schema admits "-1Gi" (a quantity); the operator refuses a negative budget.
    jobs.create(make_job("negative").set("checkpoint.memoryBudgetPerNode", "-1Gi").obj())
    failed = wait_for(lambda: jobs.condition("negative", "Failed"), 10, "the Failed condition")
    assert failed["reason"] == "InvalidSpec"
    assert "spec.checkpoint.memoryBudgetPerNode" in failed["message"]
    warning = wait_for(lambda: [e for e in jobs.events("negative") if e.type == "Warning"], 5,
                       "a warning event")
    assert warning[0].reason == "InvalidSpec"
    assert jobs.pods("negative") == []


def test_a_deleted_worker_pod_is_acted_on_within_a_second(jobs: Jobs) -> None:
    """Timed as the API shows it: from the pod's deletion in a watch to the Recovering
    condition in a watch (the operator's own view, without this test's request latency)."""
    jobs.create(make_job("watched").with_nodes(2).obj())
    wait_for(lambda: len(jobs.pods("watched")) == 2, 10, "two worker pods")
    wait_for(lambda: jobs.condition("watched", "Created"), 10, "the Created condition")
    time.sleep(0.5)  # let the pods' creation settle in the operator's cache
    pods = Watcher(jobs.core.list_namespaced_pod, jobs.ns,
                   field_selector="metadata.name=watched-worker-1", timeout_seconds=30)
    job = Watcher(jobs.custom.list_namespaced_custom_object, naming.GROUP, naming.VERSION,
                  jobs.ns, naming.PLURAL, field_selector="metadata.name=watched",
                  timeout_seconds=30)
    try:
        wait_for(lambda: pods.events and job.events, 10, "both watches to run")
        started = time.monotonic()
        jobs.core.delete_namespaced_pod("watched-worker-1", jobs.ns, grace_period_seconds=0)
        deleted_at = wait_for(lambda: pods.first(
            lambda p: p.metadata.deletion_timestamp is not None, started)
            or pods.first(lambda p: True, started, types=("DELETED",)), 10, "the deletion")
        recovering_at = wait_for(lambda: job.first(
            lambda j: any(c["type"] == "Recovering"
                          for c in (j.get("status") or {}).get("conditions") or []),
            started), 10, "Recovering in the job watch")
    finally:
        pods.stop()
        job.stop()
    elapsed = recovering_at - deleted_at
    print(f"pod deletion in the API -> Recovering in the API: {elapsed * 1000:.0f} ms "
          f"(delete request -> Recovering: {(recovering_at - started) * 1000:.0f} ms)")
    condition = jobs.condition("watched", "Recovering")
    assert "rank 1: the pod was deleted" in condition["message"]
    assert jobs.get("watched")["status"]["restarts"] == 1
    assert elapsed < 1.0, f"the failure was recorded {elapsed:.2f} s after the pod was deleted"


def test_two_operator_replicas_never_both_act(
    control_plane: Any, gemini_crd: dict[str, Any], kube_api: client.ApiClient, job_namespace: str,
) -> None:
    lease = "gemini-operator-ha-test"
    first = OperatorThread(control_plane.kubeconfig, "replica-a", lease_name=lease).start()
    second = OperatorThread(control_plane.kubeconfig, "replica-b", lease_name=lease).start()
    try:
        coordination = client.CoordinationV1Api(kube_api)

        def holder_now() -> Any:
            try:
                found: Any = coordination.read_namespaced_lease(lease, "default")
                return found.spec.holder_identity
            except ApiException as err:
                if err.status == 404:
                    return None
                raise

        holder = wait_for(holder_now, 10, "a lease holder")
        assert holder in ("replica-a", "replica-b")
        time.sleep(3)  # several election rounds
        assert holder_now() == holder
        leaders = [op for op in (first, second) if op.leads()]
        assert [op.options.identity for op in leaders] == [holder]
    finally:
        first.stop()
        second.stop()


def test_a_restarted_operator_takes_over_without_mistaking_pods_for_lost(
    jobs: Jobs, gemini_operator: OperatorThread,
) -> None:
    jobs.create(make_job("durable").with_nodes(3).obj())
    wait_for(lambda: len(jobs.pods("durable")) == 3, 10, "three worker pods")
    wait_for(lambda: jobs.condition("durable", "Created"), 10, "the Created condition")
    uids = {p.metadata.uid for p in jobs.pods("durable")}
    gemini_operator.restart()
    registry = gemini_operator.runtime.metrics.registry
    wait_for(lambda: (registry.get_sample_value("gemini_operator_reconciles_total") or 0) >= 1,
             10, "the new operator to reconcile")
    time.sleep(1)
    job = jobs.get("durable")
    assert job["status"]["restarts"] == 0 and job["status"]["state"] in ("Created", "Running")
    assert jobs.condition("durable", "Recovering") is None
    assert {p.metadata.uid for p in jobs.pods("durable")} == uids
