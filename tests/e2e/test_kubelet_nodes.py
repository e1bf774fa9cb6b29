# Over 500 lines: CI's proof of every fault kind on real kubelet nodes; the cases share one
# set of nodes, images and operator, and each case's helpers sit beside it.
"""The images built from the Dockerfile, on real kubelet nodes: CI's proof of every fault kind.

`gemini local up --kubelet --nodes 4 --images operator,sidecar,examples --with-s3`: four real
kubelets (containerd, runc) with the images built here (hack/build-images.sh, cached) in their
containerd, and the local S3 listening where their pods reach the host. The Helm chart
installs the operator from its image. A GeminiJob of two workers runs in the sidecar image
(Python and `gemini launch`) with the operator's native sidecar: three crashes of the training
process are each recovered in place by the launcher, which tells the operator at once (a
failure hint to the host's address on the pods' side), the container never restarting; a kill
of the whole trainer container (through containerd) is recovered after the kubelet restarts
it. A second job whose training process outgrows its container's memory limit is OOM-killed by
the kernel and fails naming that cause and the limit. A third, labelled for Kueue's queue, is
admitted by the real Kueue and runs. The shipped FSDP example recovers a crash in its warm
standby (the shipped ZeRO-3 one trains with its spare node held: `./dev long`). Then
examples/train_gpt_zero3.py trains with DeepSpeed in the examples image: first through a
hang, a sidecar crash, a sidecar hang and a partition healed later; then a crash restored
from local memory, then a node lost while it sends a replica (the last complete one is
restored) whose recovery outlives the operator's container, killed meanwhile. Three workers
with three copies per shard lose two nodes at once, then one node during the recovery of
another: both times the last holder serves every shard. Four workers placed across two zones
lose a whole zone and restore from the other. Four workers whose links are slowed until
replication lags lose a node at a seeded moment (three in `./dev long`), restored from peer
memory within the effective interval + 1 steps. One job with one copy per shard rides out an
S3 outage while a persist is due, is suspended to S3 and resumed from it, then loses a node
and restores the step committed to S3; the cluster's Prometheus, configured by the Prometheus
Operator from the chart's monitors and rules, fires and clears the S3 alert and answers every
dashboard panel for it. Every kept rank's losses equal an uninterrupted run's.
Last (`./dev long`, `./dev soak`), a soak of failures of every kind in a random order
(tests/e2e/kubelet_soak.py), spare kubelet nodes added as it goes. `helm uninstall` removes
the operator.
"""

from __future__ import annotations

import contextlib
import copy
import os
import random
import re
import signal
import statistics
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest
import yaml
from boto3.s3.transfer import TransferConfig
from kubernetes import client, config

from gemini_demo.crash import kill_training_process
from gemini_demo.reference import ReferenceRun
from gemini_demo.reference_cache import ReferenceCache
from gemini_local import cluster, faults, images
from gemini_local import s3 as s3_server
from gemini_local.controlplane import ControlPlane
from gemini_local.nodeagent.podspec import parse_quantity
from gemini_local.s3 import S3Endpoint
from gemini_operator.core import naming
from gemini_sidecar.s3 import JobIdentity, S3Store, committed_steps
from tests.cluster.test_operator import Jobs
from tests.e2e import kubelet_monitoring as monitored
from tests.e2e import test_lagging_replication as lag
from tests.e2e.kubelet_soak import (
    FAILURES,
    SOAK_MODEL,
    KubeletSoak,
    failure_kinds,
    reference_in_background,
)
from tests.e2e.kubelet_training import (
    IMAGE_EXAMPLE,
    MODEL,
    TRAINING,
    add_spare,
    all_resumed_at,
    as_templated,
    assert_losses,
    create_job,
    delete_job,
    ensure_free_nodes,
    finished,
    held_replicas,
    job_token,
    newest_step,
    rank_of,
    recovery_after,
    restarts,
    resumed_at,
    set_aside_for_training,
    status_of,
    steps,
    succeeds_as_uninterrupted,
    trainer_log,
    training_job,
    workers,
)
from tests.e2e.padded_trainer import EXAMPLE_ENV
from tests.e2e.test_examples import MANIFESTS, REPO, TINY, with_options
from tests.e2e.test_fault_matrix_b import (
    begun,
    checkpoint,
    persisted_after,
    request_persist,
    sidecar_inventory,
    stuck_sending,
)
from tests.fixtures.helm import CHART, Helm
from tests.fixtures.isolated_nodes import cordoned
from tests.fixtures.kubelet_host import missing_tools
from tests.fixtures.nodes import wait_until
from tests.fixtures.s3 import create_credentials_secret, make_client, persistence_spec
from tests.fixtures.trainers import SharedReferences

pytestmark = [pytest.mark.e2e, pytest.mark.kubelet]

SYSTEM, JOB = "gemini-system", "sleeper"
# Each epoch's process prints that it started, sleeps, and finishes: a recovery restarts it.
# The epoch comes from the launcher's environment: the process's own line says which start it
# is (its output and the launcher's log interleave as the two processes are scheduled).
COMMAND = ["python", "-c", "import os, time; print('rank', os.environ['RANK'], 'started in "
           "epoch', os.environ['GEMINI_RESTART_EPOCH'], flush=True); time.sleep(30); "
           "print('trained', flush=True)"]
# The S3 job's run: time for an outage, a suspend and a lost shard before the last step (the
# same content as test_two_jobs's reference: one cached run serves both).
LONGER_STEPS = 24
DURABLE = "durable"
LONGER = [*MODEL[:MODEL.index("--steps") + 1], str(LONGER_STEPS),
          *MODEL[MODEL.index("--steps") + 2:]]


@pytest.fixture(scope="module")
def kubelet_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    if os.geteuid() != 0:
        pytest.skip("real kubelet nodes need root")
    if missing := missing_tools():
        pytest.fail(f"missing {', '.join(missing)}: run ./dev setup")
    state_dir = tmp_path_factory.mktemp("kubelet-images")
    started = time.monotonic()
    try:
        info = cluster.up(state_dir, cluster.Topology(nodes=4, zones=1, racks=1), kubelet=True,
                          images=("operator", "sidecar", "examples"), timeout=120,
                          with_kueue=True, with_s3=True, with_monitoring=True)
        print(f"images built or cached, 4 kubelet nodes up with them imported, S3: "
              f"{time.monotonic() - started:.1f} s")
        plane = ControlPlane.load(state_dir)
        assert plane is not None
        yield {"state_dir": state_dir, "info": info, "plane": plane,
               "api": config.new_client_from_config(str(plane.kubeconfig))}
    finally:
        cluster.down(state_dir)


def _job(name: str) -> dict[str, Any]:
    return {"apiVersion": naming.API_VERSION, "kind": naming.KIND,
            "metadata": {"name": name, "namespace": "default"},
            # No warm standby: it would import torch for a sleeper (a restart of one spawns in
            # a blink); the crash run in a standby is the FSDP example's case.
            "spec": {"numNodes": 2, "failurePolicy": {"maxRestarts": 5, "warmStandby": False},
                     "template": {"image": images.image_name("sidecar"), "command": COMMAND}}}


def _status(custom: client.CustomObjectsApi) -> dict[str, Any]:
    return status_of(custom, JOB)


def _recovered(custom: client.CustomObjectsApi, epoch: int) -> dict[str, Any] | None:
    status = _status(custom)
    last = status.get("lastRecovery") or {}
    running = status.get("state") == "Running" and last.get("epoch", 0) >= epoch
    return last if running and last.get("completionTime") else None


def _started_in_epoch(core: client.CoreV1Api, pod: str, epoch: int) -> bool:
    """The launcher started the training process in `epoch` and it printed its first line."""
    return re.search(rf"^rank \d+ started in epoch {epoch}$", trainer_log(core, pod),
                     re.M) is not None


def _wait_started(core: client.CoreV1Api, pod: str, epoch: int) -> None:
    try:
        wait_until(lambda: _started_in_epoch(core, pod, epoch), 30,
                   f"{pod}'s launcher to start the training process in epoch {epoch}",
                   interval=0.2)
    except AssertionError as err:
        tail = "\n".join(trainer_log(core, pod).splitlines()[-30:])
        raise AssertionError(f"{err}\n--- {pod}'s trainer log, last lines:\n{tail}") from err


def _an_oom_killed_job_fails_naming_the_memory_limit(custom: client.CustomObjectsApi,
                                                     core: client.CoreV1Api) -> None:
    grow = "import time; time.sleep(1); x = bytearray(400 << 20); print('allocated')"
    body = {"apiVersion": naming.API_VERSION, "kind": naming.KIND,
            "metadata": {"name": "greedy", "namespace": "default"},
            "spec": {"numNodes": 1, "checkpoint": {"replicas": 1},
                     "failurePolicy": {"maxRestarts": 1, "warmStandby": False},
                     "template": {"spec": {"containers": [{
                         "name": "trainer", "image": images.image_name("sidecar"),
                         "command": ["python", "-c", grow],
                         "resources": {"limits": {"memory": "256Mi"}}}]}}}}
    create_job(custom, body)

    status = finished(custom, "greedy", 120)
    assert status["state"] == "Failed", status
    failed = next(c for c in status["conditions"] if c["type"] == "Failed")
    print(f"greedy job: {failed['message'].splitlines()[0]}")
    assert "out of memory: the kernel's OOM killer" in failed["message"], failed
    assert "memory limit (256 MiB)" in failed["message"], failed
    assert "allocated" not in trainer_log(core, "greedy-worker-0")


def _a_queued_job_is_admitted_by_kueue_and_runs(custom: client.CustomObjectsApi) -> None:
    body = _job("queued")
    body["metadata"]["labels"] = {"kueue.x-k8s.io/queue-name": cluster.LOCAL_QUEUE}
    body["spec"]["template"]["command"] = ["python", "-c", "print('trained')"]
    create_job(custom, body)

    assert finished(custom, "queued", 120)["state"] == "Succeeded"
    workloads = custom.list_namespaced_custom_object(
        "kueue.x-k8s.io", "v1beta2", "default", "workloads",
        label_selector=f"{naming.LABEL_JOB}=queued")["items"]
    conditions = {c["type"]: c["status"] for w in workloads
                  for c in w.get("status", {}).get("conditions", [])}
    assert conditions.get("Admitted") == "True" and conditions.get("Finished") == "True", \
        conditions


def _image_id(pod: Any, container: str) -> str:
    statuses = [*(pod.status.container_statuses or []),
                *(pod.status.init_container_statuses or [])]
    return str(next(s.image_id for s in statuses if s.name == container))


HINT_PORT = 8090


@pytest.fixture(scope="module")
def installed_operator(kubelet_cluster: dict[str, Any], helm: Helm) -> Iterator[str]:
    """The chart installed from the operator image on a kubelet node; that node's name.
    `helm uninstall` at the end removes it."""
    plane: ControlPlane = kubelet_cluster["plane"]
    core = client.CoreV1Api(kubelet_cluster["api"])
    core.create_namespace({"metadata": {"name": SYSTEM}})
    # No kube-proxy and no DNS on these nodes: the operator runs in the node's network and
    # reaches the API server on loopback; launchers send failure hints to the host's address
    # on the pods' side (its hint server listens on every address).
    port = urlparse(plane.api_url).port
    env = (f'[{{"name":"KUBERNETES_SERVICE_HOST","value":"127.0.0.1"}},'
           f'{{"name":"KUBERNETES_SERVICE_PORT","value":"{port}"}}]')
    hints = f"http://{kubelet_cluster['info']['hostFromPods']}:{HINT_PORT}"
    result = helm.run(["install", "gemini", str(CHART), "--namespace", SYSTEM, "--wait",
                       "--timeout", "120s", "--set", "hostNetwork=true",
                       "--set", "image.pullPolicy=Never", "--set", f"failureHints.url={hints}",
                       "--set", f"failureHints.port={HINT_PORT}",
                       "--set-json", f"operator.extraEnv={env}", *monitored.HELM_VALUES],
                      kubeconfig=plane.kubeconfig, timeout=180)
    assert result.returncode == 0, result.stderr
    (operator_pod,) = core.list_namespaced_pod(SYSTEM).items
    assert operator_pod.spec.node_name.startswith("127.0.50."), operator_pod.spec.node_name
    assert operator_pod.spec.containers[0].image == images.image_name("operator")
    yield str(operator_pod.spec.node_name)
    result = helm.run(["uninstall", "gemini", "--namespace", SYSTEM, "--wait", "--timeout",
                       "60s"], kubeconfig=plane.kubeconfig, timeout=120)
    assert result.returncode == 0, result.stderr
    wait_until(lambda: not core.list_namespaced_pod(SYSTEM).items, 60,
               "the operator pod to be gone")


@pytest.mark.proves("helm-install", "trainer-container-kill", "repeated-crashes", "oom",
                    "kueue-admission")
def test_helm_installs_the_operator_image_and_a_job_recovers_crashes_in_place(
        kubelet_cluster: dict[str, Any], installed_operator: str) -> None:
    state_dir: Path = kubelet_cluster["state_dir"]
    api = kubelet_cluster["api"]
    core, custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
    create_job(custom, _job(JOB))
    wait_until(lambda: _status(custom).get("state") == "Running", 90, "the job Running",
               interval=0.5)
    pods = {p.metadata.name: p for p in core.list_namespaced_pod(
        "default", label_selector=f"{naming.LABEL_JOB}={JOB}").items}
    sidecar_image_id = _image_id(next(iter(pods.values())), "gemini-sidecar")
    assert all(_image_id(p, "trainer") == sidecar_image_id for p in pods.values())
    name = next(iter(pods))
    epoch = 1
    downtimes = []
    for _ in range(3):  # the training process dies, its launcher (the container) stays
        kill_training_process(state_dir, "default", name)
        killed = time.monotonic()
        crash = wait_until(lambda e=epoch: _recovered(custom, e + 1), 60,
                           "the training process's crash recovered", interval=0.2)
        assert crash["cause"] == "software" and crash["source"] == "Local", crash
        epoch = crash["epoch"]
        _wait_started(core, name, epoch)
        downtimes.append(time.monotonic() - killed)
    assert restarts(core, name) == 0, "the kubelet restarted the trainer container"
    # The launcher told the operator of each crash at once (gemini_trainer.failure_hint): the
    # line is written on the operator's 202 only. Best effort by design (1 s per try), so a
    # loaded box may lose one; none answered means the pods cannot reach the hint server.
    told = trainer_log(core, name).count("told the operator of the failure")
    assert told >= 1, "no failure hint reached the operator (failureHints.url)"
    print(f"training process crashes: kill -> training again {[round(d, 2) for d in downtimes]}"
          f" s, no container restart, {told} of 3 told to the operator by a failure hint")

    faults.kill_container(state_dir, "default", name, "trainer")
    crash = wait_until(lambda: _recovered(custom, epoch + 1), 60, "the crash recovered",
                       interval=0.5)
    assert crash["cause"] == "software" and crash["source"] == "Local", crash
    _wait_started(core, name, crash["epoch"])
    assert restarts(core, name) == 1

    print(f"container kill recovered in {crash['durationSeconds']} s")

    final = finished(custom, JOB, 120)
    assert final["state"] == "Succeeded", final
    assert "trained" in trainer_log(core, name)

    _an_oom_killed_job_fails_naming_the_memory_limit(custom, core)
    _a_queued_job_is_admitted_by_kueue_and_runs(custom)


# A kubelet node here reports the box's 2 CPUs.
NODE_CPUS = 2


def _shipped_on_kubelet_nodes(manifest: dict[str, Any], s3: dict[str, Any]) -> dict[str, Any]:
    """The shipped manifest with the edits the 2-core box needs, and only those: 2 workers
    (and at most 2 copies of a shard), a tiny model, one thread, a CPU request a node can
    grant, the local S3 at the pods' address. Image, command, memory, placement, spares,
    budgets and failure policy stay as shipped."""
    job = copy.deepcopy(manifest)
    job["metadata"]["namespace"] = "default"
    spec = job["spec"]
    spec["numNodes"] = 2
    spec["checkpoint"]["replicas"] = min(spec["checkpoint"].get("replicas", 2), 2)
    (trainer,) = spec["template"]["spec"]["containers"]
    trainer["args"] = with_options(trainer["args"], {**TINY, "--step-sleep": "1.0"})
    trainer["env"] = [{"name": "OMP_NUM_THREADS", "value": "1"}]
    requests = trainer["resources"]["requests"]
    sidecar = spec["checkpoint"].get("sidecar", {}).get("resources", {}).get("requests", {})
    room = NODE_CPUS - parse_quantity(sidecar.get("cpu", "0"))  # FSDP's 2: as shipped
    if parse_quantity(requests["cpu"]) > room:
        requests["cpu"] = str(float(room))
    spec["persistence"].update(bucketURI=f"s3://{s3['bucket']}/{job['metadata']['name']}",
                               endpoint=s3["podURL"])
    return job


def _example_on_kubelet_nodes(kubelet_cluster: dict[str, Any], example: str
                              ) -> tuple[dict[str, Any], Path, list[str]]:
    """`_shipped_on_kubelet_nodes` of examples/<example>, its S3 credentials Secret made (the
    one the manifest's comment tells users to make); the job, and the host's copy of the
    script the image runs with its arguments (for the reference run)."""
    job = _shipped_on_kubelet_nodes(yaml.safe_load(MANIFESTS[example].read_text()),
                                    kubelet_cluster["info"]["s3"])
    (trainer,) = job["spec"]["template"]["spec"]["containers"]
    assert trainer["image"] == images.image_name("examples"), trainer["image"]
    core = client.CoreV1Api(kubelet_cluster["api"])
    secret = job["spec"]["persistence"]["credentialsSecretRef"]["name"]
    with contextlib.suppress(client.ApiException):  # the other example made it already
        core.delete_namespaced_secret(secret, "default")
    create_credentials_secret(core, "default", S3Endpoint.from_dict(
        kubelet_cluster["info"]["s3"]), secret)
    return job, REPO / trainer["command"][1].removeprefix("/app/"), trainer["args"]


@contextlib.contextmanager
def _example_running(kubelet_cluster: dict[str, Any], example: str, tmp_path: Path
                     ) -> Iterator[tuple[str, ReferenceRun]]:
    """`_example_on_kubelet_nodes` created, with its loopback reference run started; the job's
    name and that run. The reference stops and the job is deleted after."""
    custom = client.CustomObjectsApi(kubelet_cluster["api"])
    job, script, args = _example_on_kubelet_nodes(kubelet_cluster, example)
    reference = ReferenceRun(script, args, 2, tmp_path / "reference",
                             cache=ReferenceCache()).start()
    try:
        create_job(custom, job)
        yield job["metadata"]["name"], reference
    finally:
        reference.stop()
    delete_job(custom, job["metadata"]["name"])


@pytest.mark.proves("shipped-examples", "trainer-crash", "warm-standby")
def test_the_fsdp_example_as_shipped_recovers_a_crash_in_its_image(
        kubelet_cluster: dict[str, Any], installed_operator: str, tmp_path: Path) -> None:
    """examples/geminijob-fsdp.yaml in the examples image it names (train_fsdp.py with PyTorch
    FSDP2), its resources (a real cgroup limit) and placement as shipped: a crash of a
    worker's training process is restored in place from local memory, its new epoch run in
    the launcher's warm standby, the job succeeds with a checkpoint in S3, and rank 0's
    losses equal an uninterrupted loopback run's."""
    state_dir: Path = kubelet_cluster["state_dir"]
    api = kubelet_cluster["api"]
    core, custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
    with _example_running(kubelet_cluster, "fsdp", tmp_path) as (name, reference):
        crashed = f"{name}-worker-1"
        wait_until(lambda: newest_step(core, crashed) >= 4, 240, f"{crashed} at step 4",
                   interval=0.5)
        kill_training_process(state_dir, "default", crashed)
        crash = wait_until(lambda: recovery_after(custom, 1, name), 90, "the crash recovered",
                           interval=0.5)
        assert (crash["cause"], crash["source"]) == ("software", "Local"), crash
        wait_until(lambda: resumed_at(trainer_log(core, crashed), crash["restoredStep"]), 60,
                   f"{crashed} to step on from the restored step")
        # The launcher ran the new epoch in its warm standby (imports begun before the crash),
        # not in a process spawned after it.
        started = f"epoch {crash['epoch']}, warm standby)"
        assert started in trainer_log(core, crashed), trainer_log(core, crashed)[-3000:]
        final = finished(custom, name)
        assert final["state"] == "Succeeded", final
        assert final.get("checkpoint", {}).get("persistedStep"), final  # S3 as configured
        print(f"fsdp example on kubelet nodes: crash recovered in {crash['durationSeconds']} s")
        assert_losses(core, f"{name}-worker-0", reference.wait(timeout=300))


@pytest.mark.long  # CI runs the FSDP example; the spare's placeholder: tests/cluster/test_spares.py
@pytest.mark.proves("shipped-examples")
def test_the_zero3_example_as_shipped_trains_to_the_reference_losses_with_its_spare(
        kubelet_cluster: dict[str, Any], installed_operator: str, tmp_path: Path) -> None:
    """examples/geminijob-zero3.yaml (DeepSpeed ZeRO-3 in the examples image, every knob set)
    with its memory requests and limits, sidecar resources, memory budget, domain-aware
    placement, spare node and failure policy as shipped: the spare's placeholder holds a
    third node at the spare priority while the job trains, the job succeeds with a checkpoint
    in S3, and rank 0's losses equal an uninterrupted loopback run's."""
    api = kubelet_cluster["api"]
    core, custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
    with _example_running(kubelet_cluster, "zero3", tmp_path) as (name, reference):
        wait_until(lambda: status_of(custom, name).get("state") == "Running", 120,
                   f"{name} Running", interval=0.5)
        spare = naming.spare_pod_name(name, 0)
        wait_until(lambda: core.read_namespaced_pod(spare, "default").status.phase == "Running",
                   60, f"{spare} running", interval=0.5)
        pods = {p.metadata.name: p for p in core.list_namespaced_pod(
            "default", label_selector=f"{naming.LABEL_JOB}={name}").items}
        nodes = {n: p.spec.node_name for n, p in pods.items()}
        assert sorted(pods) == sorted([f"{name}-worker-0", f"{name}-worker-1", spare]), nodes
        assert len(set(nodes.values())) == 3, f"not one node each: {nodes}"
        worker_priority = pods[f"{name}-worker-0"].spec.priority
        assert pods[spare].spec.priority < worker_priority, "a spare would not give way"
        wait_until(lambda: status_of(custom, name).get("spares", {}).get("reason") == "Held", 30,
                   "status.spares to say Held", interval=0.5)
        final = finished(custom, name)
        assert final["state"] == "Succeeded", final
        assert final.get("checkpoint", {}).get("persistedStep"), final  # S3 as configured
        print(f"zero3 example on kubelet nodes: {len(nodes)} pods on {sorted(nodes.values())}, "
              f"persisted step {final['checkpoint']['persistedStep']}")
        assert_losses(core, f"{name}-worker-0", reference.wait(timeout=300))


@pytest.fixture(autouse=True)
def lost_nodes_deleted(kubelet_cluster: dict[str, Any]) -> Iterator[None]:
    """After each case, the nodes it lost are deleted from the API: there a lost node stays
    Ready for the node grace period, and the next case's pods must not be scheduled onto it
    (a cloud's node controller deletes such a node too)."""
    yield
    state_dir: Path = kubelet_cluster["state_dir"]
    core = client.CoreV1Api(kubelet_cluster["api"])
    for node in core.list_node().items:
        if not faults.node_running(state_dir, node.metadata.name):
            with contextlib.suppress(client.ApiException):
                core.delete_node(node.metadata.name)


def retire(state_dir: Path, core: client.CoreV1Api, nodes: Iterable[str]) -> None:
    """Spare kubelet nodes a case added, stopped once it is done (each idle kubelet and its
    containerd take CPU from the cases after it) and deleted from the API at once (a stopped
    node stays Ready there for the node grace period, and its processes may not all be gone
    yet when `lost_nodes_deleted` looks)."""
    for node in nodes:
        with contextlib.suppress(faults.FaultError):  # lost during the case already
            faults.lose_node(state_dir, node)
        with contextlib.suppress(client.ApiException):
            core.delete_node(node)


@pytest.fixture(scope="module")
def training_nodes(kubelet_cluster: dict[str, Any]) -> None:
    """Every node labelled and tainted for training; the job's service account, priority class
    and dataset made."""
    set_aside_for_training(kubelet_cluster["api"])


FAULTS = "faults"


@pytest.mark.proves("hang", "sidecar-crash", "sidecar-hang", "partition-heal")
def test_deepspeed_training_on_kubelet_nodes_rides_out_a_hang_a_sidecar_crash_and_a_partition(
        kubelet_cluster: dict[str, Any], installed_operator: str, training_nodes: None,
        shared_references: SharedReferences) -> None:
    """The fault matrix's other faults on real kubelets, one job (m = 2) through all three: a
    training process stopped (SIGSTOP) is found by the hang timeout and restarted in place
    from local memory; the other worker's sidecar container killed is restarted by the kubelet
    and holds its peer's replica again without a recovery, then hangs (SIGSTOP) for 5 s and,
    let go, holds a newer replica, again without a recovery; that peer's node cut off (its
    kubelet from the API server, its pods from every other node's) is replaced, its shard
    fetched from the restarted sidecar, and once healed the node ends the old pod's
    containers. The survivor's losses equal an uninterrupted run's."""
    state_dir: Path = kubelet_cluster["state_dir"]
    api = kubelet_cluster["api"]
    core, custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
    body = training_job(FAULTS, step_sleep=2.0)
    body["spec"]["failurePolicy"]["hangTimeoutSeconds"] = 20
    create_job(custom, body)
    wait_until(lambda: status_of(custom, FAULTS).get("state") == "Running", 120,
               "the job Running", interval=0.5)
    pods, cut, kept = workers(core, FAULTS, installed_operator)
    reference = shared_references(2, MODEL, rank=rank_of(kept))
    wait_until(lambda: newest_step(core, cut) >= 2, 240, f"{cut} to train 2 steps",
               interval=0.5)

    stopped = kill_training_process(state_dir, "default", cut, sig=signal.SIGSTOP)
    try:
        hang = wait_until(lambda: recovery_after(custom, 1, FAULTS), 120, "the hang recovered",
                          interval=0.5)
    except AssertionError:
        os.killpg(stopped, signal.SIGKILL)
        raise
    assert hang["cause"] == "hang" and hang["source"] == "Local", hang
    wait_until(lambda: resumed_at(trainer_log(core, cut), hang["restoredStep"]), 60,
               f"{cut} to step on from the restored step")
    assert restarts(core, cut) == 0, "the hung process was restarted in place"

    rank = rank_of(cut)
    wait_until(lambda: held_replicas(core, FAULTS, kept, 0) == {rank}, 60,
               f"{kept}'s sidecar to hold rank {rank}'s replica")
    killed_at = newest_step(core, cut)
    faults.kill_container(state_dir, "default", kept, naming.SIDECAR_CONTAINER)
    # It restarts empty: coverage is back once it holds a replica newer than the kill.
    wait_until(lambda: held_replicas(core, FAULTS, kept, killed_at) == {rank}, 90,
               f"the restarted sidecar of {kept} to hold rank {rank}'s replica again",
               interval=0.5)
    assert status_of(custom, FAULTS)["lastRecovery"]["epoch"] == hang["epoch"]
    # The restarted sidecar hangs for a while (every process of its container stopped; the
    # soak's 2-8 s, below its liveness probe's 23 s): let go, it takes a replica newer than
    # the hang, and no recovery is needed.
    hung_at = newest_step(core, cut)
    faults.kill_container(state_dir, "default", kept, naming.SIDECAR_CONTAINER, signal.SIGSTOP)
    try:
        time.sleep(5)
    finally:
        faults.kill_container(state_dir, "default", kept, naming.SIDECAR_CONTAINER,
                              signal.SIGCONT)
    wait_until(lambda: held_replicas(core, FAULTS, kept, hung_at) == {rank}, 90,
               f"the sidecar of {kept} to hold a replica newer than its hang", interval=0.5)
    assert status_of(custom, FAULTS)["lastRecovery"]["epoch"] == hang["epoch"]

    node = pods[cut].spec.node_name
    faults.partition_node(state_dir, node)
    try:
        cut_off = wait_until(lambda: recovery_after(custom, hang["epoch"], FAULTS), 120,
                             "the partitioned node's worker recovered", interval=0.5)
    finally:
        faults.heal_node(state_dir, node)
    assert cut_off["cause"] == "hardware" and cut_off["source"] == "Peers", cut_off
    assert core.read_namespaced_pod(cut, "default").spec.node_name != node
    all_resumed_at(core, (kept, cut), cut_off["restoredStep"])
    wait_until(lambda: not faults.container_pids(state_dir, "default", cut, "trainer", node),
               90, f"the healed node {node} to end the old pod's containers", interval=1)
    print(f"on kubelet nodes: hang recovered in {hang['durationSeconds']} s "
          f"({hang['breakdown']}), the sidecar "
          f"crash without a recovery, the partition in {cut_off['durationSeconds']} s "
          f"({cut_off['breakdown']})")
    succeeds_as_uninterrupted(custom, core, FAULTS, kept, reference)


@pytest.mark.proves("trainer-crash", "node-loss", "loss-mid-replication",
                    "operator-killed-mid-recovery")
def test_deepspeed_training_survives_a_crash_and_a_node_lost_mid_send_outliving_the_operator(
        kubelet_cluster: dict[str, Any], installed_operator: str,
        training_nodes: None, shared_references: SharedReferences) -> None:
    """examples/train_gpt_zero3.py in the examples image (torch and DeepSpeed as the Dockerfile
    installs them), 2 workers, m = 2, on real kubelets whose nodes are tainted and labelled
    for training, with a dataset volume, a service account and a priority class: one
    worker's training process killed (restored in place from local memory), then the other
    worker's node lost while it sends a version to the survivor (the survivor's sidecar
    container frozen, SIGSTOP through containerd, so that the version stays in flight, and
    thawed after the loss: it holds that version begun, not complete); the replacement,
    templated alike, fetches the last complete version from the survivor's sidecar over pod
    IPs. While that recovery replaces or fetches, the operator's container is SIGKILLed: the
    kubelet restarts it in the same pod, whose identity (its name and uid, set by the chart)
    retakes the Lease at once, without a transition, and the restarted operator finishes the
    recovery from status.recovery. The survivor's losses equal an uninterrupted run of the
    host's venv bit for bit, and each restore is followed by the restored step + 1 in the
    trainers' own logs."""
    state_dir: Path = kubelet_cluster["state_dir"]
    api = kubelet_cluster["api"]
    core, custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
    leases = client.CoordinationV1Api(api)
    create_job(custom, training_job())
    wait_until(lambda: status_of(custom, TRAINING).get("state") == "Running", 120,
               "the training job Running", interval=0.5)
    # The worker that stays survives both faults; its losses are compared.
    _, lost, kept = workers(core, TRAINING, installed_operator)
    reference = shared_references(2, MODEL, rank=rank_of(kept))

    def newest(pod: str) -> int:
        return newest_step(core, pod)

    wait_until(lambda: newest(kept) >= 3, 240, f"{kept} to train 3 steps", interval=0.5)
    kill_training_process(state_dir, "default", kept)
    crash = wait_until(lambda: recovery_after(custom, 1), 90, "the crash recovered",
                       interval=0.5)
    assert crash["cause"] == "software" and crash["source"] == "Local", crash
    wait_until(lambda: resumed_at(trainer_log(core, kept), crash["restoredStep"]), 60,
               f"{kept} to step on from the restored step")
    assert restarts(core, kept) == 0, "the training process was restarted in place"

    reached = newest(kept)
    wait_until(lambda: newest(kept) >= reached + 2, 60, "two more steps", interval=0.5)
    sender, receiver = rank_of(lost), rank_of(kept)
    wait_until(lambda: held_replicas(core, TRAINING, kept, 0) == {sender}, 60,
               f"{kept}'s sidecar to hold rank {sender}'s replica")
    operator, restarted = _operator(core)
    lease = leases.read_namespaced_lease("gemini-operator", SYSTEM).spec
    assert lease.holder_identity == f"{operator.metadata.name}_{operator.metadata.uid}"
    token = job_token(core, TRAINING)
    into, out_of = (core.read_namespaced_pod(p, "default") for p in (kept, lost))
    lost_node = out_of.spec.node_name
    faults.kill_container(state_dir, "default", kept, naming.SIDECAR_CONTAINER, signal.SIGSTOP)
    try:
        in_flight = wait_until(lambda: stuck_sending(out_of.status.pod_ip, token, receiver), 60,
                               f"rank {sender} to be stuck sending a version to rank {receiver}")
        faults.lose_node(state_dir, lost_node)
    finally:
        faults.kill_container(state_dir, "default", kept, naming.SIDECAR_CONTAINER,
                              signal.SIGCONT)
    half = wait_until(lambda: begun(sidecar_inventory(into.status.pod_ip, token), sender,
                                    in_flight), 30,
                      f"{kept}'s sidecar to take in the begun version {in_flight}")
    assert not half[0]["complete"] and half[0]["received_bytes"] < half[0]["bytes"], half
    during = wait_until(lambda: _recovery_in(custom, TRAINING, ("Replacing", "Fetching")),
                        120, "the recovery to replace or fetch", interval=0.1)
    faults.kill_container(state_dir, SYSTEM, operator.metadata.name, "operator")
    killed = time.monotonic()
    loss = wait_until(lambda: recovery_after(custom, crash["epoch"]), 180,
                      "the restarted operator to finish the node loss's recovery", interval=0.5)
    took = time.monotonic() - killed
    assert loss["cause"] == "hardware" and loss["source"] == "Peers", loss
    assert sender in loss["failedRanks"] and loss["stepsLost"] <= 1, loss
    assert loss["restoredStep"] < in_flight, (loss, in_flight)  # the last complete version
    again, restarts_now = _operator(core)
    assert again.metadata.uid == operator.metadata.uid and restarts_now > restarted
    after = leases.read_namespaced_lease("gemini-operator", SYSTEM).spec
    assert after.holder_identity == lease.holder_identity, after
    assert after.lease_transitions == lease.lease_transitions, (lease, after)
    replacement = core.read_namespaced_pod(lost, "default").spec.node_name
    assert replacement not in (lost_node, None), replacement
    for pod in (kept, lost):
        wait_until(lambda p=pod: resumed_at(trainer_log(core, p), loss["restoredStep"]), 120,
                   f"{pod} to step on from the restored step")
        as_templated(core.read_namespaced_pod(pod, "default"), trainer_log(core, pod))
    print(f"on kubelet nodes: crash recovered in {crash['durationSeconds']} s (step "
          f"{crash['restoredStep']}); rank {sender}'s node lost while sending version "
          f"{in_flight} ({half[0]['received_bytes']} of {half[0]['bytes']} bytes in), restored "
          f"{loss['restoredStep']} in {loss['durationSeconds']} s ({loss['breakdown']}); the "
          f"operator killed during {during['phase']}, restarted in its pod, finished it "
          f"{took:.1f} s after the kill")

    succeeds_as_uninterrupted(custom, core, TRAINING, kept, reference)


GROUP = "group"


def _recovery_in(custom: client.CustomObjectsApi, job: str, phases: tuple[str, ...]
                 ) -> dict[str, Any] | None:
    """status.recovery while it is in one of `phases`, else None."""
    recovery: dict[str, Any] = status_of(custom, job).get("recovery") or {}
    return recovery if recovery.get("phase") in phases else None


def _recoveries_finished(core: client.CoreV1Api, job: str) -> int:
    return sum(1 for e in core.list_namespaced_event("default").items
               if e.involved_object.name == job and e.involved_object.kind == naming.KIND
               and e.reason == "RecoveryFinished")


def _lose_nodes_of(state_dir: Path, core: client.CoreV1Api, pods: list[str]) -> set[str]:
    nodes = {core.read_namespaced_pod(p, "default").spec.node_name for p in pods}
    for node in nodes:
        faults.lose_node(state_dir, node)
    return nodes


@pytest.mark.proves("m-minus-one-at-once", "loss-during-recovery")
def test_m_minus_one_nodes_lost_at_once_and_a_node_lost_during_a_recovery_restore_from_peers(
        kubelet_cluster: dict[str, Any], installed_operator: str, training_nodes: None,
        shared_references: SharedReferences) -> None:
    """The fault matrix's multi-node losses on real kubelets: 3 workers, m = 3 (every node
    holds every shard). Ranks 1 and 2's nodes lost at once (m - 1 of the group): one recovery,
    both replacements fetch their shards from rank 0's sidecar, the last holder. Then rank 1's
    node lost, and rank 2's while that recovery replaces or fetches: it joins that recovery,
    again from rank 0. Each restore is followed by the restored step + 1 in every worker's
    log, and rank 0's losses equal an uninterrupted 3-worker run's. (The operator's node takes
    no worker meanwhile, so every worker's node can be lost.)"""
    state_dir: Path = kubelet_cluster["state_dir"]
    api = kubelet_cluster["api"]
    core, custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
    kept, others = f"{GROUP}-worker-0", [f"{GROUP}-worker-{r}" for r in (1, 2)]
    with cordoned(core, [installed_operator]):
        started = time.monotonic()
        added = ensure_free_nodes(state_dir, api, set(), 3 + 2 + 2)  # workers, replacements
        print(f"{len(added)} spare kubelet nodes Ready in {time.monotonic() - started:.1f} s")
        reference = shared_references(3, MODEL, rank=0)  # before: it takes the CPUs
        create_job(custom, training_job(GROUP, replicas=3, step_sleep=2.0, nodes=3))
        wait_until(lambda: newest_step(core, kept) >= 3, 240, f"{kept} to train 3 steps",
                   interval=0.5)
        wait_until(lambda: held_replicas(core, GROUP, kept, 0) == {1, 2}, 60,
                   f"{kept}'s sidecar to hold ranks 1 and 2's replicas")
        kept_uid = core.read_namespaced_pod(kept, "default").metadata.uid

        lost = _lose_nodes_of(state_dir, core, others)
        first = wait_until(lambda: recovery_after(custom, 1, GROUP), 180,
                           "the m-1 node losses recovered", interval=0.5)
        assert first["cause"] == "hardware" and first["source"] == "Peers", first
        # Rank 0's training process may fail too (its collective broke): it restarts in place.
        assert {1, 2} <= set(first["failedRanks"]) and first["stepsLost"] <= 1, first
        assert core.read_namespaced_pod(kept, "default").metadata.uid == kept_uid
        assert not {core.read_namespaced_pod(p, "default").spec.node_name
                    for p in others} & lost
        all_resumed_at(core, (kept, *others), first["restoredStep"])

        wait_until(lambda: held_replicas(core, GROUP, kept, first["restoredStep"]) == {1, 2},
                   60, f"{kept}'s sidecar to hold the replacements' newer replicas")
        _lose_nodes_of(state_dir, core, others[:1])
        during = wait_until(lambda: _recovery_in(custom, GROUP, ("Replacing", "Fetching")),
                            120, "the recovery to replace or fetch", interval=0.1)
        _lose_nodes_of(state_dir, core, others[1:])
        second = wait_until(lambda: recovery_after(custom, first["epoch"], GROUP), 180,
                            "the second node loss to join the recovery", interval=0.5)
        assert second["cause"] == "hardware" and second["source"] == "Peers", second
        assert {1, 2} <= set(second["failedRanks"]) and second["stepsLost"] <= 1, second
        all_resumed_at(core, (kept, *others), second["restoredStep"])
        print(f"on kubelet nodes: m-1 losses at once recovered in {first['durationSeconds']} s "
              f"({first['breakdown']}); a loss during {during['phase']} joined a recovery of "
              f"{second['durationSeconds']} s ({second['breakdown']})")
        final = finished(custom, GROUP)
        assert final["state"] == "Succeeded", final
        assert _recoveries_finished(core, GROUP) == 2
        assert_losses(core, kept, reference)
    retire(state_dir, core, added)


def _operator(core: client.CoreV1Api) -> tuple[Any, int]:
    """The operator's pod and its container's restart count."""
    (pod,) = core.list_namespaced_pod(SYSTEM).items
    return pod, restarts(core, pod.metadata.name, "operator", SYSTEM)


ZONES = "zones"


@pytest.mark.proves("zone-loss")
def test_losing_a_whole_zone_restores_every_rank_from_its_peer_in_the_other_zone(
        kubelet_cluster: dict[str, Any], installed_operator: str, training_nodes: None,
        shared_references: SharedReferences) -> None:
    """4 workers, m = 2, on four new kubelet nodes in two zones (every other node cordoned):
    the failure-aware placement gives each group one node in each zone. Both nodes of zone-c
    are lost at once; each lost rank's replacement, on a spare added in zone-b, fetches its
    shard from its group's peer there. Every worker resumes at the restored step + 1, and a
    kept rank's losses equal an uninterrupted 4-worker run's (the scheduler may put rank 0 in
    either zone)."""
    state_dir: Path = kubelet_cluster["state_dir"]
    api = kubelet_cluster["api"]
    core, custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
    shared_references(4, MODEL)  # every rank's, before the job: the run takes the CPUs
    with cordoned(core, [n.metadata.name for n in core.list_node().items]):
        zone_of = {add_spare(state_dir, api, zone, f"rack-{zone}-{i}"): zone
                   for zone in ("zone-b", "zone-c") for i in range(2)}
        create_job(custom, training_job(ZONES, replicas=2, step_sleep=2.0, nodes=4))
        placement = wait_until(lambda: status_of(custom, ZONES).get("placement"), 240,
                               "the placement of the 4 workers", interval=0.5)
        groups = [{zone_of[placement["nodes"][str(r)]] for r in g} for g in placement["groups"]]
        assert groups == [{"zone-b", "zone-c"}] * 2, placement
        spares = {add_spare(state_dir, api, "zone-b", "rack-spare") for _ in range(2)}
        lost_ranks = {int(r) for r, n in placement["nodes"].items() if zone_of[n] == "zone-c"}
        pods = [f"{ZONES}-worker-{r}" for r in range(4)]
        wait_until(lambda: min(newest_step(core, p) for p in pods) >= 3, 240,
                   "every worker to train 3 steps", interval=0.5)
        for node, zone in zone_of.items():
            if zone == "zone-c":
                faults.lose_node(state_dir, node)
        last = wait_until(lambda: recovery_after(custom, 1, ZONES), 180,
                          "the zone loss recovered", interval=0.5)
        assert last["cause"] == "hardware" and last["source"] == "Peers", last
        # The survivors' training processes may fail too (their collectives broke).
        assert lost_ranks <= set(last["failedRanks"]) and last["stepsLost"] <= 1, last
        moved = {core.read_namespaced_pod(f"{ZONES}-worker-{r}", "default").spec.node_name
                 for r in lost_ranks}
        assert moved == spares, (moved, spares)
        all_resumed_at(core, pods, last["restoredStep"])
        print(f"on kubelet nodes: zone loss (ranks {sorted(lost_ranks)}) recovered in "
              f"{last['durationSeconds']} s ({last['breakdown']})")
        kept = min(set(range(4)) - lost_ranks)
        succeeds_as_uninterrupted(custom, core, ZONES, f"{ZONES}-worker-{kept}",
                                  shared_references(4, MODEL, rank=kept))
    retire(state_dir, core, [*zone_of, *spares])


LAGGING = "lagging"
PADDED = "padded-trainer"  # the ConfigMap that carries tests/e2e/padded_trainer.py


@pytest.mark.proves("lagging-replication")
@pytest.mark.timeout(600 + 90 * 3)
@pytest.mark.parametrize("losses", [1, pytest.param(3, marks=pytest.mark.long)])
def test_node_losses_while_replication_lags_over_slowed_kubelet_links_restore_from_peers(
        kubelet_cluster: dict[str, Any], installed_operator: str, training_nodes: None,
        shared_references: SharedReferences, losses: int) -> None:
    """tests/e2e/test_lagging_replication.py's case on real kubelets: 4 workers (m = 2) of the
    padded trainer (from a ConfigMap, beside the examples image's example), each on a kubelet
    node of its own whose bridge is slowed (nftables) so that one replication takes about 3
    iterations. The trainers skip snapshots while one is on its way: the effective interval
    grows and the recoverable version stays pinned. Then LAG_LOSSES node losses at seeded
    moments: each restored from peers, at least the step that was recoverable before it,
    losing at most the effective interval + 1 steps; every rank's log restored each planned
    step and went on with the next; rank 0's losses equal an uninterrupted run's. One loss in
    CI, three in `./dev long`."""
    state_dir: Path = kubelet_cluster["state_dir"]
    api = kubelet_cluster["api"]
    core, custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
    # Steps for the lag to set in (about 12) and each loss (at most 8 after the last restore).
    model = lag.model(24 + 7 * losses)
    reference = shared_references(lag.WORKERS, model, rank=0)  # before: it takes the CPUs
    seed = lag.new_seed()
    print(f"lagging on kubelet nodes: seed {seed} (replay: GEMINI_LAG_SEED={seed})")
    core.create_namespaced_config_map("default", {
        "metadata": {"name": PADDED},
        "data": {"padded_trainer.py": lag.PADDED_TRAINER.read_text()}})
    added: list[str] = []

    def spare() -> str:
        added.append(add_spare(state_dir, api))
        return added[-1]

    job = lag.LaggingJob(Jobs(api, "default"), state_dir, spare, LAGGING, seed,
                         steps=lag.steps_of(model))
    try:
        with cordoned(core, [n.metadata.name for n in core.list_node().items]):
            for _ in range(lag.WORKERS):
                spare()
            body = training_job(LAGGING, replicas=lag.REPLICAS, step_sleep=lag.STEP_SLEEP,
                                model=model, nodes=lag.WORKERS,
                                script=f"/padding/{lag.PADDED_TRAINER.name}",
                                env={lag.PADDING_ENV: str(lag.PADDING_BYTES),
                                     EXAMPLE_ENV: IMAGE_EXAMPLE},
                                config_maps={PADDED: "/padding"})
            body["spec"]["failurePolicy"]["maxRestarts"] = losses + 5
            create_job(custom, body)
            base = lag.start(job)
            job.lose_nodes(losses, base, bound=lambda interval: interval + 1)
            intervals = [loss.interval for loss in job.done]
            assert statistics.median(intervals) >= 2, job.say(
                f"the effective interval at the losses: {intervals}")
            job.finish(reference)
    finally:
        job.heal_links()
        core.delete_namespaced_config_map(PADDED, "default")
    print("\n".join(loss.line() for loss in job.done))
    print(f"on kubelet nodes: {job.summary()}")
    delete_job(custom, LAGGING)
    wait_until(lambda: not core.list_namespaced_pod(
        "default", label_selector=f"{naming.LABEL_JOB}={LAGGING}").items, 120,
        "the lagging job's pods to be gone")
    retire(state_dir, core, added)  # seven kubelets fewer to run beside the next tests


@pytest.mark.proves("s3-outage", "suspend-resume", "group-loss-s3", "prometheus-dashboards",
                    "live-metrics")
def test_one_s3_job_rides_out_an_outage_suspends_resumes_and_restores_a_lost_shard_from_s3(
        kubelet_cluster: dict[str, Any], installed_operator: str, training_nodes: None,
        shared_references: SharedReferences) -> None:
    """A job with one in-memory copy per shard (m = 1) persisting to the local S3 over the pod
    network (the first step, then on request). A training process crash is restored in place.
    The S3 gateway stops while a persist is due: the persist fails with a Warning and
    status.checkpoint.persistError, training goes on, and once the gateway is back (on the
    bridge address too) the request is retried and a later step committed. Then the job is
    suspended: its newest in-memory step is saved to S3 before the pods go, and the resume
    restores that step from S3 in new pods. Last, a worker's node is lost, its shard's only
    copy with it: both workers restore the step committed to S3 (the replacement on a free
    node). Every restore is followed by the restored step + 1 in the
    trainers' own logs, and the kept rank printed an uninterrupted run's losses.

    Throughout, the cluster's Prometheus scrapes the operator, the sidecars and the launchers
    through the chart's monitors: the chart's S3-failing alert fires during the outage and
    clears after it, every dashboard panel returns series for the job after the node loss, and
    the recovery counters count the crash, the resume and the loss."""
    state_dir: Path = kubelet_cluster["state_dir"]
    api = kubelet_cluster["api"]
    core, custom, jobs = client.CoreV1Api(api), client.CustomObjectsApi(api), Jobs(api, "default")
    s3 = kubelet_cluster["info"]["s3"]
    endpoint = S3Endpoint.from_dict(s3)
    create_credentials_secret(core, "default", endpoint, name="s3-outage")
    ensure_free_nodes(state_dir, api, set(), 3)  # two workers and a replacement
    references = [shared_references(2, LONGER, rank=r) for r in (0, 1)]  # before: CPUs
    body = training_job(DURABLE, replicas=1, step_sleep=2.0, model=LONGER)
    body["spec"]["persistence"] = {**persistence_spec(endpoint, "outage/", 3600, "s3-outage"),
                                   "endpoint": s3["podURL"]}
    create_job(custom, body)
    rank0 = f"{DURABLE}-worker-0"
    first = wait_until(lambda: checkpoint(jobs, DURABLE).get("persistedStep"), 240,
                       "the first step persisted to S3", interval=0.5)
    prometheus = monitored.prometheus_of(kubelet_cluster["info"])
    kill_training_process(state_dir, "default", rank0)
    crash = wait_until(lambda: recovery_after(custom, 0, DURABLE), 90, "the crash recovered",
                       interval=0.5)
    assert crash["cause"] == "software" and crash["source"] == "Local", crash
    wait_until(lambda: resumed_at(trainer_log(core, rank0), crash["restoredStep"]), 60,
               f"{rank0} to step on from the restored step")
    s3_server.pause_s3(state_dir / "s3")  # the gateway process ends: requests are refused
    try:
        down_at = newest_step(core, rank0)
        request_persist(jobs, DURABLE, DURABLE)
        error = wait_until(lambda: checkpoint(jobs, DURABLE).get("persistError"), 120,
                           "status.checkpoint.persistError", interval=0.5)
        wait_until(lambda: newest_step(core, rank0) > down_at, 60,
                   "a step trained while S3 is down", interval=0.5)
        alert = monitored.wait_firing(prometheus, monitored.S3_FAILING, DURABLE)
        assert status_of(custom, DURABLE)["state"] == "Running"
        assert checkpoint(jobs, DURABLE)["persistedStep"] == first
    finally:
        s3_server.resume_s3(state_dir / "s3")
    # The upload's own failure, not a retry's (gemini_sidecar.transfers tells it once).
    assert str(error).startswith("step ") and "S3" in str(error), error
    warnings = [e for e in jobs.events(DURABLE) if e.reason == "PersistFailed"]
    assert warnings and warnings[0].type == "Warning", [e.reason for e in jobs.events(DURABLE)]
    persisted = wait_until(lambda: persisted_after(checkpoint(jobs, DURABLE), first), 120,
                           "the pending persist retried once S3 is back", interval=0.5)
    store = S3Store(make_client(endpoint), endpoint.bucket, "outage", TransferConfig())
    owner = JobIdentity("default", DURABLE, jobs.get(DURABLE)["metadata"]["uid"])
    assert persisted in committed_steps(store, owner)
    assert {"PersistFailed", "PersistRecovered"} <= {e.reason for e in jobs.events(DURABLE)}
    print(f"on kubelet nodes, S3 down: persisted {first}, failed with {error!r}, "
          f"then {persisted} once it was back")

    in_memory = wait_until(lambda: (step := checkpoint(jobs, DURABLE).get("inMemoryStep", 0))
                           >= persisted + 2 and step, 120, "two newer steps in memory",
                           interval=0.5)
    unasked = status_of(custom, DURABLE).get("lastRecovery")
    assert unasked["epoch"] == crash["epoch"], f"a recovery no failure asked for: {unasked}"
    jobs.patch(DURABLE, {"suspend": True})
    wait_until(lambda: status_of(custom, DURABLE).get("state") == "Suspended"
               and not jobs.pods(DURABLE), 180, "the suspended job's pods to be gone")
    saved = checkpoint(jobs, DURABLE)["persistedStep"]
    assert in_memory <= saved < LONGER_STEPS - 4, (in_memory, saved)  # saved mid-way
    assert saved in committed_steps(store, owner)
    assert "SuspendCheckpointSaved" in {e.reason for e in jobs.events(DURABLE)}
    jobs.patch(DURABLE, {"suspend": False})
    resumed = wait_until(lambda: recovery_after(custom, crash["epoch"], DURABLE), 240,
                         "the resume to restore", interval=0.5)
    assert resumed["cause"] == "resume" and resumed["source"] == "S3", resumed
    assert resumed["restoredStep"] >= saved, resumed
    pods, lost, kept = workers(core, DURABLE, installed_operator)
    all_resumed_at(core, pods, resumed["restoredStep"])
    assert "ResumedFromCheckpoint" in {e.reason for e in jobs.events(DURABLE)}
    print(f"on kubelet nodes, suspend and resume: {in_memory} in memory, {saved} saved to S3, "
          f"restored {resumed['restoredStep']} in {resumed['durationSeconds']} s")

    wait_until(lambda: newest_step(core, kept) > resumed["restoredStep"], 120,
               f"{kept} to train a step after the resume", interval=0.5)
    committed = max(committed_steps(store, owner))
    faults.lose_node(state_dir, pods[lost].spec.node_name)
    recovery = wait_until(lambda: recovery_after(custom, resumed["epoch"], DURABLE), 180,
                          "the recovery from S3", interval=0.5)
    assert recovery["source"] == "S3" and recovery["restoredStep"] >= committed, recovery
    all_resumed_at(core, (kept, lost), recovery["restoredStep"])
    print(f"on kubelet nodes, from S3: committed step {committed}, restored step "
          f"{recovery['restoredStep']} in {recovery['durationSeconds']} s "
          f"({recovery['breakdown']})")
    time.sleep(4)  # two scrapes of the replacement's sidecar and launcher
    panels = monitored.panels_answer(prometheus, "default", DURABLE)
    # The recovery just finished shows on the dashboard (not lost as a series' first sample).
    assert monitored.panel_value(panels, "Recoveries by source", source="S3") > 0, panels
    counted = monitored.recoveries_counted(prometheus)
    assert {("software", "Local"), ("resume", "S3"), ("hardware", "S3")} <= set(counted), counted
    monitored.wait_cleared(prometheus, monitored.S3_FAILING, DURABLE)
    print(f"Prometheus: {monitored.S3_FAILING} fired during the outage "
          f"({alert['annotations']['summary']}) and cleared after; recoveries by cause and "
          f"source {counted}; every dashboard query answered:\n  "
          + "\n  ".join(r.summary() for r in panels))
    final = finished(custom, DURABLE)
    assert final["state"] == "Succeeded", final
    # The suspended pods' logs went with them: the kept rank's pod printed every step after
    # the resumed one, each (replays included) with the uninterrupted run's loss.
    printed = steps(trainer_log(core, kept))
    reference = references[rank_of(kept)]
    assert {s for s, _ in printed} == set(range(resumed["restoredStep"] + 1,
                                                LONGER_STEPS + 1)), printed
    assert all(loss == reference[step] for step, loss in printed), printed
    delete_job(custom, DURABLE)


@pytest.mark.soak
@pytest.mark.long  # a count: every kind it draws has its CI proof above
@pytest.mark.proves("trainer-crash", "node-loss", "partition-heal", "sidecar-crash",
                    "sidecar-hang")
@pytest.mark.timeout(600 + 120 * FAILURES)
def test_a_soak_of_random_failures_on_kubelet_nodes_recovers_each_and_leaks_nothing(
        kubelet_cluster: dict[str, Any], installed_operator: str, training_nodes: None,
        shared_references: SharedReferences) -> None:
    seed = int(os.environ.get("GEMINI_SOAK_SEED") or random.randrange(2**32))
    rng = random.Random(seed)
    kinds = failure_kinds(rng, FAILURES)
    print(f"kubelet soak: seed {seed} (GEMINI_SOAK_SEED replays it), failures {kinds}")
    api = kubelet_cluster["api"]
    custom = client.CustomObjectsApi(api)
    reference = reference_in_background(shared_references)
    create_job(custom, training_job("soak", model=SOAK_MODEL))
    wait_until(lambda: status_of(custom, "soak").get("state") == "Running", 120,
               "the soak job Running", interval=0.5)
    soak = KubeletSoak(kubelet_cluster["state_dir"], api, installed_operator, "soak", rng)
    soak.run(kinds)
    print(f"kubelet soak: {soak.durations}")
    final = soak.finish_and_delete()
    assert final["state"] == "Succeeded", final
    assert final["restarts"] == sum(k in ("trainer", "node", "partition") for k in kinds), final
    assert soak.losses() == reference.result(timeout=600), soak.story()
