"""GeminiJobs queued by the real Kueue controller (built from Go modules, gemini_local.kueue):
with a ClusterQueue that fits one job, the second job waits suspended, without pods, and
starts when the first finishes. The admitted flavor's node labels place the workers; a node
loss of the running job is recovered by a replacement pod while the other job still waits
(the queue never blocks a recovery). Both jobs' losses equal an uninterrupted run's, and the
recovery resumed at the restored step (the trainer's own log)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from gemini_local import faults, kueue
from gemini_local.controlplane import ControlPlane
from gemini_operator.core import naming, queueing
from gemini_operator.core.quantity import parse_quantity
from gemini_operator.core.render import JobRef
from tests.cluster.test_operator import Jobs, wait_for
from tests.cluster.test_operator_recovery import ARGS, ENV, _recovered_after, losses
from tests.e2e.test_two_jobs import assert_resumed_at, step_of
from tests.fixtures.operator import OperatorThread
from tests.fixtures.s3 import create_credentials_secret, persistence_spec
from tests.fixtures.trainers import EXAMPLE, SharedReferences
from tests.unit.operator.builders import make_job

pytestmark = [pytest.mark.cluster, pytest.mark.e2e, pytest.mark.timeout(900)]
POOL = "gemini.test/kueue-pool"
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
LONGER = list(ARGS)
LONGER[LONGER.index("--steps") + 1] = "16"  # time for a node loss while the other waits


@pytest.fixture(scope="module")
def kueue_running(control_plane: ControlPlane) -> Iterator[ControlPlane]:
    state = control_plane.state_dir / "kueue"
    kueue.start_kueue(control_plane, state)
    try:
        yield control_plane
    finally:
        kueue.stop_kueue(state)


@pytest.fixture(scope="module")
def reference(shared_references: SharedReferences) -> dict[int, str]:
    return shared_references(2, LONGER)


def queued_job(name: str, queue: str, args: list[str] = LONGER, **labels: str
               ) -> dict[str, Any]:
    template = {"spec": {"containers": [{
        "name": "trainer", "image": "gemini:local", "command": ["python", str(EXAMPLE), *args],
        "env": ENV, "resources": {"requests": {"cpu": "500m"}}}]}}
    # No trainer crashes here: no warm standby (a spare interpreter importing DeepSpeed).
    job = (make_job(name).with_nodes(2).with_replicas(2).set("template", template)
           .set("failurePolicy.maxRestarts", 4).set("failurePolicy.warmStandby", False).obj())
    job["metadata"]["labels"] = {queueing.QUEUE_LABEL: queue, **labels}
    return job


def pool_of(local_cluster: Any, core: client.CoreV1Api, count: int) -> tuple[str, set[str]]:
    """`count` fresh nodes labelled with a pool of their own: the pool and the nodes."""
    pool, nodes = f"pool-{uuid.uuid4().hex[:5]}", set()
    for _ in range(count):
        node = local_cluster.add_spare().name
        core.patch_node(node, {"metadata": {"labels": {POOL: pool}}})
        nodes.add(node)
    return pool, nodes


def conditions(wl: dict[str, Any]) -> dict[str, str]:
    return {c["type"]: c["status"] for c in (wl.get("status") or {}).get("conditions", [])}


def workload(custom: client.CustomObjectsApi, jobs: Jobs, name: str) -> dict[str, Any]:
    """The job's Workload; {} while there is none."""
    time.sleep(0.2)  # polled: spare the API server
    uid = jobs.get(name)["metadata"]["uid"]
    wl_name = queueing.workload_name(JobRef(name, jobs.ns, uid))
    try:
        return dict(custom.get_namespaced_custom_object(
            queueing.GROUP, queueing.VERSION, jobs.ns, queueing.WORKLOADS, wl_name))
    except ApiException as err:
        if err.status == 404:
            return {}
        raise


def cpu_of(wl: dict[str, Any]) -> float:
    """The CPU the workload asks for: each pod's containers and native sidecars."""
    total = 0.0
    for pod_set in wl["spec"]["podSets"]:
        spec = pod_set["template"]["spec"]
        running = spec["containers"] + [c for c in spec.get("initContainers", [])
                                        if c.get("restartPolicy") == "Always"]
        per_pod = sum(float(parse_quantity(c.get("resources", {}).get("requests", {}).get(
            "cpu", 0))) for c in running)
        total += per_pod * pod_set["count"]
    return total


@pytest.mark.proves("kueue-admission")
def test_the_example_queues_admit_the_example_job(
    kueue_running: ControlPlane, gemini_operator: OperatorThread, kube_api: client.ApiClient,
    job_namespace: str,
) -> None:
    """examples/kueue-queues.yaml is accepted by Kueue's CRDs and admits
    examples/geminijob-kueue.yaml with its priority (nothing runs: admission only)."""
    jobs, custom = Jobs(kube_api, job_namespace), client.CustomObjectsApi(kube_api)
    kueue.kubectl(kueue_running, "apply", "--server-side", "-n", job_namespace,
                  "-f", str(EXAMPLES / "kueue-queues.yaml"))
    (job,) = yaml.safe_load_all((EXAMPLES / "geminijob-kueue.yaml").read_text())
    name = job["metadata"]["name"]
    job["spec"]["suspend"] = True
    jobs.create(job)
    wait_for(lambda: jobs.state(name) == "Suspended", 30, "the suspended example")
    time.sleep(3)  # more than a poll of the queue: a suspended job makes no Workload
    assert not workload(custom, jobs, name)
    # Admission only: the example image's script is not here, so the trainer just waits.
    (trainer,) = job["spec"]["template"]["spec"]["containers"]
    jobs.patch(name, {"suspend": False, "template": {"spec": {"containers": [{
        **trainer, "command": ["python", "-c", "import time; time.sleep(600)"], "args": []}]}}})
    wl = wait_for(lambda: workload(custom, jobs, name), 30, "the example's Workload")
    assert wl["spec"]["priority"] == 100 and wl["spec"]["queueName"] == "training"
    # as Kueue's v1beta2 schema stores it (a field it does not know would be pruned)
    assert wl["spec"]["priorityClassRef"] == {
        "group": "kueue.x-k8s.io", "kind": "WorkloadPriorityClass", "name": "research"}
    wait_for(lambda: conditions(workload(custom, jobs, name)).get("Admitted") == "True", 30,
             "Kueue to admit the example")
    wait_for(lambda: jobs.condition(name, "Suspended")["reason"] == "Admitted", 30,
             "the example to be admitted")
    wait_for(lambda: len(jobs.pods(name)) == 4, 30, "its 4 workers")
    jobs.patch(name, {"suspend": True})  # the user's suspend gives the quota back
    wait_for(lambda: not workload(custom, jobs, name), 120, "its Workload to be deleted")
    jobs.delete(name)


def relabel(jobs: Jobs, name: str, labels: dict[str, str | None]) -> None:
    body = {"metadata": {"labels": labels}}
    jobs.custom.patch_namespaced_custom_object(naming.GROUP, naming.VERSION, jobs.ns,
                                               naming.PLURAL, name, body)


@pytest.mark.proves("kueue-admission")
def test_a_job_moved_to_another_queue_is_queued_there_and_one_taken_off_gives_its_workload_up(
    kueue_running: ControlPlane, gemini_operator: OperatorThread, kube_api: client.ApiClient,
    job_namespace: str,
) -> None:
    """Moving a waiting job to another LocalQueue makes its Workload again there (the old one,
    queued where nothing admits it, is deleted); taking a running job off its queue deletes
    its Workload (the quota is handed back) and leaves its workers running."""
    jobs, custom = Jobs(kube_api, job_namespace), client.CustomObjectsApi(kube_api)
    kueue.kubectl(kueue_running, "apply", "--server-side", "-n", job_namespace,
                  "-f", str(EXAMPLES / "kueue-queues.yaml"))
    sleeper = ["python", "-c", "import time; time.sleep(600)"]
    job = queued_job("mover", "nowhere", args=[])
    job["spec"]["template"]["spec"]["containers"][0]["command"] = sleeper
    jobs.create(job)
    old = wait_for(lambda: workload(custom, jobs, "mover"), 30, "its Workload in 'nowhere'")
    assert jobs.condition("mover", "Suspended")["reason"] == "WaitingForAdmission"
    relabel(jobs, "mover", {queueing.QUEUE_LABEL: "training"})
    new = wait_for(lambda: (wl := workload(custom, jobs, "mover")) and wl["metadata"]["uid"]
                   != old["metadata"]["uid"] and wl, 30, "its Workload made again")
    assert new["spec"]["queueName"] == "training"
    wait_for(lambda: jobs.condition("mover", "Suspended")["reason"] == "Admitted", 30,
             "the moved job to be admitted")
    workers = wait_for(lambda: len(got := jobs.pods("mover")) == 2 and got, 30, "its workers")
    pods = {p.metadata.uid for p in workers}

    relabel(jobs, "mover", {queueing.QUEUE_LABEL: None})
    try:
        wait_for(lambda: not workload(custom, jobs, "mover"), 30, "its Workload to be deleted")
    except AssertionError as err:
        events = [(e.reason, e.message) for e in jobs.events("mover")]
        raise AssertionError(f"{err}: {workload(custom, jobs, 'mover')}, {events}") from None
    time.sleep(2)
    assert {p.metadata.uid for p in jobs.pods("mover")} == pods  # still running, untouched
    reasons = [e.message for e in jobs.events("mover") if e.reason == "WorkloadUpdated"]
    assert any("label was removed" in m for m in reasons), reasons
    assert any("older version of the job (LocalQueue 'nowhere' -> 'training')" in m
               for m in reasons), reasons
    jobs.delete("mover")


@pytest.mark.long  # two training jobs in turn, a node loss between: `./dev long`
@pytest.mark.proves("kueue-admission", "node-loss")
def test_a_queue_that_fits_one_job_runs_the_second_after_the_first_and_never_blocks_recovery(
    kueue_running: ControlPlane, local_cluster: Any, gemini_operator: OperatorThread,
    kube_api: client.ApiClient, job_namespace: str, reference: dict[int, str],
) -> None:
    core, custom = client.CoreV1Api(kube_api), client.CustomObjectsApi(kube_api)
    state, ns, jobs = local_cluster.state_dir, job_namespace, Jobs(kube_api, job_namespace)
    queue = f"q-{uuid.uuid4().hex[:5]}"
    pool, pool_nodes = pool_of(local_cluster, core, 3)  # two workers, one for a replacement

    jobs.create(queued_job("first", queue))
    wait_for(lambda: jobs.state("first") == "Suspended", 60, "first to wait for admission")
    assert jobs.condition("first", "Suspended")["reason"] == "WaitingForAdmission"
    need = cpu_of(wait_for(lambda: workload(custom, jobs, "first"), 30, "first's Workload"))
    assert need >= 1.0  # two workers at 500m each, and their sidecars
    # Exactly one job's CPU: the second job cannot be admitted while the first holds it.
    kueue.queue_setup(kueue_running, ns, queue, {"cpu": f"{need:g}", "memory": "1Ti"},
                      flavor=f"flavor-{pool}", node_labels={POOL: pool})
    wait_for(lambda: step_of(state, ns, "first-worker-0") >= 3, 300, "first to train")
    assert {p.spec.node_name for p in jobs.pods("first")} <= pool_nodes  # the flavor's nodes
    wait_for(lambda: conditions(workload(custom, jobs, "first")).get("PodsReady") == "True",
             30, "Kueue to be told that every worker is ready")

    jobs.create(queued_job("second", queue))
    wait_for(lambda: jobs.state("second") == "Suspended", 60, "second to wait")
    wait_for(lambda: "QuotaReserved" in conditions(workload(custom, jobs, "second")), 30,
             "Kueue to judge the second Workload")
    assert not jobs.pods("second")
    second_wl = workload(custom, jobs, "second")
    reserved = {c["type"]: c for c in second_wl["status"]["conditions"]}["QuotaReserved"]
    assert reserved["status"] == "False", reserved  # Kueue: it does not fit now
    print(f"second waits: {reserved['message']}")

    # A node loss of the running job: its replacement pod is made at once, queue or not.
    before = jobs.get("first")["status"]
    lost = {p.metadata.name: p for p in jobs.pods("first")}["first-worker-1"]
    faults.lose_node(state, lost.spec.node_name)
    last = wait_for(lambda: _recovered_after(jobs, "first", before), 240, "first's recovery")
    assert last["source"] == "Peers" and last["cause"] == "hardware", last
    assert_resumed_at(state, ns, "first-worker-1", int(last["restoredStep"]))
    assert jobs.state("second") == "Suspended" and not jobs.pods("second")

    wait_for(lambda: jobs.state("first") in ("Succeeded", "Failed"), 300, "first to finish")
    assert jobs.state("first") == "Succeeded", jobs.get("first")["status"]
    finished_at = time.monotonic()
    wait_for(lambda: conditions(workload(custom, jobs, "first")).get("Finished") == "True", 30,
             "first's Workload to be Finished")
    wait_for(lambda: jobs.condition("second", "Suspended")["reason"] == "Admitted", 60,
             "second to be admitted")
    print(f"second admitted {time.monotonic() - finished_at:.1f} s after first finished")
    wait_for(lambda: jobs.state("second") in ("Succeeded", "Failed"), 300, "second to finish")
    assert jobs.state("second") == "Succeeded", jobs.get("second")["status"]
    assert {p.spec.node_name for p in jobs.pods("second")} <= pool_nodes
    for name in ("first", "second"):
        got, conflicts = losses(state, ns, f"{name}-worker-0")
        assert not conflicts and got == reference, name
        jobs.delete(name)


@pytest.mark.proves("kueue-preemption", "suspend-resume")
def test_a_preempted_job_saves_its_memory_gives_way_and_resumes_from_s3_when_readmitted(
    kueue_running: ControlPlane, local_cluster: Any, gemini_operator: OperatorThread,
    kube_api: client.ApiClient, job_namespace: str, reference: dict[int, str],
    s3_server: Any, s3_prefix: str,
) -> None:
    core, custom = client.CoreV1Api(kube_api), client.CustomObjectsApi(kube_api)
    state, ns, jobs = local_cluster.state_dir, job_namespace, Jobs(kube_api, job_namespace)
    queue = f"q-{uuid.uuid4().hex[:5]}"
    pool, _ = pool_of(local_cluster, core, 2)
    for name, value in (("gemini-low", 100), ("gemini-high", 1000)):
        kueue.priority_class(kueue_running, name, value)
    create_credentials_secret(core, ns, s3_server.endpoint)
    slow = [*LONGER[:-1], "1.0"]  # slow steps: the eviction comes mid-run
    low = queued_job("low", queue, slow, **{queueing.PRIORITY_LABEL: "gemini-low"})
    # One periodic upload (the first step), then none: what is newer when Kueue evicts the
    # job is in memory only, and only the save before the pods go can keep it.
    low["spec"]["persistence"] = persistence_spec(s3_server.endpoint, s3_prefix, 3600)
    jobs.create(low)
    need = cpu_of(wait_for(lambda: workload(custom, jobs, "low"), 30, "low's Workload"))
    assert workload(custom, jobs, "low")["spec"]["priority"] == 100
    kueue.queue_setup(kueue_running, ns, queue, {"cpu": f"{need:g}", "memory": "1Ti"},
                      flavor=f"flavor-{pool}", node_labels={POOL: pool},
                      preemption={"withinClusterQueue": "LowerPriority"})
    checkpoint = lambda: (jobs.get("low") or {}).get("status", {}).get("checkpoint", {})  # noqa: E731
    first = wait_for(lambda: checkpoint().get("persistedStep"), 300, "a step persisted")
    wait_for(lambda: checkpoint().get("inMemoryStep", 0) >= first + 2, 240,
             "two newer steps complete in memory")
    in_memory = checkpoint()["inMemoryStep"]

    jobs.create(queued_job("high", queue, **{queueing.PRIORITY_LABEL: "gemini-high"}))
    wait_for(lambda: jobs.state("low") == "Suspended" and not jobs.pods("low"), 240,
             "low to be evicted and its pods gone")
    message = jobs.condition("low", "Suspended")["message"]
    assert "evicted by Kueue" in message, message
    saved = jobs.get("low")["status"]["checkpoint"]["persistedStep"]
    assert saved >= in_memory > first, jobs.get("low")["status"]["checkpoint"]
    assert "SuspendCheckpointSaved" in {e.reason for e in jobs.events("low")}
    wait_for(lambda: jobs.state("high") in ("Succeeded", "Failed"), 300, "high to finish")
    assert jobs.state("high") == "Succeeded", jobs.get("high")["status"]

    # Readmitted once high is done: low resumes from the step saved at the eviction.
    last = wait_for(lambda: ((jobs.get("low") or {}).get("status") or {}).get(
        "lastRecovery"), 300, "low to be readmitted and resume")
    print(f"preempted: saved {saved} at the eviction, then {last}")
    assert last["cause"] == "resume" and last["source"] == "S3", last
    assert last["restoredStep"] >= saved
    # The trainers' own logs: each restored that step and went on with the next (a rerun from
    # step 0 would print the same losses).
    for rank in (0, 1):
        assert_resumed_at(state, ns, f"low-worker-{rank}", int(last["restoredStep"]))
    wait_for(lambda: jobs.state("low") in ("Succeeded", "Failed"), 300, "low to finish")
    assert jobs.state("low") == "Succeeded", jobs.get("low")["status"]
    steps = int(LONGER[LONGER.index("--steps") + 1])
    got, conflicts = losses(state, ns, "low-worker-0")
    assert not conflicts
    assert set(range(last["restoredStep"] + 1, steps + 1)) <= set(got), sorted(got)
    assert got == {step: reference[step] for step in got}
    got, conflicts = losses(state, ns, "high-worker-0")
    assert not conflicts and got == reference
    for name in ("low", "high"):
        jobs.delete(name)


@pytest.fixture
def kueue_waiting_for_pods(kueue_running: ControlPlane) -> Iterator[ControlPlane]:
    """The module's Kueue restarted with waitForPodsReady (15 s); stopped afterwards."""
    state = kueue_running.state_dir / "kueue"
    kueue.stop_kueue(state)
    kueue.start_kueue(kueue_running, state, pods_ready_timeout=PODS_READY_SECONDS)
    try:
        yield kueue_running
    finally:
        kueue.stop_kueue(state)


PODS_READY_SECONDS = 15


@pytest.mark.long  # Kueue restarted with waitForPodsReady: `./dev long`
@pytest.mark.proves("kueue-admission")
def test_an_admitted_job_whose_workers_cannot_all_start_is_evicted_and_gives_its_quota_back(
    kueue_waiting_for_pods: ControlPlane, local_cluster: Any, gemini_operator: OperatorThread,
    kube_api: client.ApiClient, job_namespace: str,
) -> None:
    """All or nothing at the pod level: the flavor sends the workers to a pool without
    nodes, so none becomes ready; Kueue's waitForPodsReady evicts the workload, and the
    operator deletes the pods and hands the quota back."""
    custom, jobs = client.CustomObjectsApi(kube_api), Jobs(kube_api, job_namespace)
    queue = f"q-{uuid.uuid4().hex[:5]}"
    job = queued_job("stuck", queue)
    jobs.create(job)
    need = cpu_of(wait_for(lambda: workload(custom, jobs, "stuck"), 30, "stuck's Workload"))
    kueue.queue_setup(kueue_waiting_for_pods, job_namespace, queue,
                      {"cpu": f"{need:g}", "memory": "1Ti"}, flavor=f"flavor-{queue}",
                      node_labels={POOL: "no-such-pool"})
    wait_for(lambda: jobs.condition("stuck", "Suspended")["reason"] == "Admitted", 60,
             "stuck to be admitted")
    admitted_at = time.monotonic()
    wait_for(lambda: len(jobs.pods("stuck")) == 2, 30, "its workers (Pending)")
    wait_for(lambda: "evicted by Kueue" in jobs.condition("stuck", "Suspended")["message"],
             PODS_READY_SECONDS + 60, "Kueue to evict it")
    print(f"evicted {time.monotonic() - admitted_at:.1f} s after admission: "
          f"{jobs.condition('stuck', 'Suspended')['message']}")
    assert "PodsReady" in jobs.condition("stuck", "Suspended")["message"]
    wait_for(lambda: not jobs.pods("stuck"), 60, "its pods to be deleted")
    # The quota is handed back (then Kueue requeues it, and it is admitted again: the pool
    # still has no nodes, so the cycle repeats with a growing back-off).
    wait_for(lambda: conditions(workload(custom, jobs, "stuck")).get("QuotaReserved") ==
             "False" or jobs.condition("stuck", "Suspended")["reason"] == "Admitted", 60,
             "the quota to be handed back")
    jobs.delete("stuck")
