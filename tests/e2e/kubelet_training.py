"""The DeepSpeed training job of the kubelet e2e, as a user on a GPU cluster writes it, and the
reads its assertions need (pod logs, statuses, steps, losses)."""

from __future__ import annotations

import base64
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from kubernetes import client

from gemini.control.client import ControlClient, ControlError
from gemini_local import cluster, images
from gemini_local.cluster import RACK_LABEL, ZONE_LABEL, Topology
from gemini_operator.core import naming
from tests.cluster.test_operator import sidecar_port
from tests.fixtures.nodes import wait_until
from tests.fixtures.trainers import STEP_LINE


def status_of(custom: client.CustomObjectsApi, name: str) -> dict[str, Any]:
    job: dict[str, Any] = custom.get_namespaced_custom_object(  # type: ignore[assignment]
        naming.GROUP, naming.VERSION, "default", naming.PLURAL, name)
    return dict(job.get("status") or {})


def trainer_log(core: client.CoreV1Api, pod: str) -> str:
    try:
        return str(core.read_namespaced_pod_log(pod, "default", container="trainer"))
    except client.ApiException:
        return ""


def create_job(custom: client.CustomObjectsApi, body: dict[str, Any]) -> None:
    custom.create_namespaced_custom_object(naming.GROUP, naming.VERSION, "default",
                                           naming.PLURAL, body)


def finished(custom: client.CustomObjectsApi, name: str, timeout: float = 240
             ) -> dict[str, Any]:
    """The job's status once it Succeeded or Failed."""
    def ended() -> dict[str, Any] | None:
        status = status_of(custom, name)
        return status if status.get("state") in ("Succeeded", "Failed") else None

    found: dict[str, Any] = wait_until(ended, timeout, f"{name} to finish", interval=1)
    return found


def rank_of(pod: str) -> int:
    """The rank in a worker pod's name (`<job>-worker-<rank>`)."""
    return int(pod.rsplit("-", 1)[1])


def delete_job(custom: client.CustomObjectsApi, name: str) -> None:
    custom.delete_namespaced_custom_object(naming.GROUP, naming.VERSION, "default",
                                           naming.PLURAL, name)


def restarts(core: client.CoreV1Api, pod: str, container: str = "trainer",
             namespace: str = "default") -> int:
    statuses = core.read_namespaced_pod(pod, namespace).status.container_statuses or []
    return int(next(s.restart_count for s in statuses if s.name == container))


def job_token(core: client.CoreV1Api, job: str) -> str:
    """The job's peer-auth token (its Secret), what the sidecars' API asks for."""
    secret = core.read_namespaced_secret(naming.secret_name(job), "default")
    return base64.b64decode(secret.data[naming.SECRET_TOKEN_KEY]).decode()


TRAINING, STEPS = "gpt", 12
# examples/train_gpt_zero3.py as the examples image has it (the Dockerfile copies it there),
# the fault matrix's model: one uninterrupted reference run per session serves both.
MODEL = ["--engine", "deepspeed", "--steps", str(STEPS), "--layers", "1", "--d-model", "32"]
IMAGE_EXAMPLE = "/app/examples/train_gpt_zero3.py"


POOL = "gemini.io/pool"  # the label and taint of the nodes set aside for training
DATASET = "tokens 0-65535, shard 7"


def training_job(name: str = TRAINING, replicas: int = 2, step_sleep: float = 1.0,
                 model: list[str] = MODEL, nodes: int = 2, script: str = IMAGE_EXAMPLE,
                 env: Mapping[str, str] | None = None,
                 config_maps: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The job as a user on a GPU cluster writes it: tainted nodes picked by label, a dataset
    volume, its own service account and priority class. `script` runs with `model`'s
    arguments and `env`; `config_maps` mounts ConfigMaps (name -> folder) beside the dataset."""
    train = " ".join([f"exec python {script}", *model, f"--step-sleep {step_sleep}"])
    mounts = {"dataset": "/data", **(config_maps or {})}
    trainer = {"name": "trainer", "image": images.image_name("examples"),
               "command": ["sh", "-c", f'echo "dataset: $(cat /data/dataset.txt)" && {train}'],
               "env": [{"name": k, "value": v}
                       for k, v in {"OMP_NUM_THREADS": "1", **(env or {})}.items()],
               "volumeMounts": [{"name": n, "mountPath": at, "readOnly": True}
                                for n, at in mounts.items()]}
    pod = {"nodeSelector": {POOL: "trainers"},
           "tolerations": [{"key": POOL, "operator": "Equal", "value": "trainers",
                            "effect": "NoSchedule"}],
           "serviceAccountName": "trainer", "priorityClassName": "training",
           "volumes": [{"name": n, "configMap": {"name": n}} for n in mounts],
           "containers": [trainer]}
    return {"apiVersion": naming.API_VERSION, "kind": naming.KIND,
            "metadata": {"name": name, "namespace": "default"},
            "spec": {"numNodes": nodes, "checkpoint": {"replicas": replicas},
                     "failurePolicy": {"maxRestarts": 5}, "template": {"spec": pod}}}


def set_aside_for_training(api: client.ApiClient) -> None:
    """Label and taint every node, and make the service account, priority class and dataset
    the job names."""
    core = client.CoreV1Api(api)
    for node in core.list_node().items:
        core.patch_node(node.metadata.name, {
            "metadata": {"labels": {POOL: "trainers"}},
            "spec": {"taints": [{"key": POOL, "value": "trainers", "effect": "NoSchedule"}]}})
    core.create_namespaced_service_account("default", {"metadata": {"name": "trainer"}})
    client.SchedulingV1Api(api).create_priority_class(
        {"metadata": {"name": "training"}, "value": 1000})
    core.create_namespaced_config_map("default", {"metadata": {"name": "dataset"},
                                                  "data": {"dataset.txt": DATASET}})


def add_spare(state_dir: Path, api: client.ApiClient, zone: str | None = None,
              rack: str | None = None) -> str:
    """A fresh kubelet node, labelled and tainted for training like the others (in the
    others' zone and rack unless said); its name."""
    labels = {**Topology(nodes=1, zones=1, racks=1).labels(0), POOL: "trainers"}
    labels.update({k: v for k, v in ((ZONE_LABEL, zone), (RACK_LABEL, rack)) if v})
    name = cluster.add_kubelet_node(state_dir, labels)
    client.CoreV1Api(api).patch_node(name, {"spec": {"taints": [
        {"key": POOL, "value": "trainers", "effect": "NoSchedule"}]}})
    return name


def free_nodes(core: client.CoreV1Api, used: set[str]) -> list[str]:
    """Ready, schedulable nodes outside `used`."""
    return [n.metadata.name for n in core.list_node().items
            if n.metadata.name not in used and not n.spec.unschedulable
            and any(c.type == "Ready" and c.status == "True" for c in n.status.conditions or [])]


def ensure_free_nodes(state_dir: Path, api: client.ApiClient, used: set[str], count: int
                      ) -> list[str]:
    """Spares added until `count` Ready nodes outside `used` (the nodes of a job's pods) wait
    for its replacements (a lost node never comes back; a healed one is free again); the
    names of those added."""
    missing = count - len(free_nodes(client.CoreV1Api(api), used))
    return [add_spare(state_dir, api) for _ in range(missing)]


def as_templated(pod: Any, log: str) -> None:
    """The pod carries the template's placement, identity and priority, and its trainer read
    the dataset volume the kubelet mounted."""
    assert pod.spec.node_selector == {POOL: "trainers"}, pod.spec.node_selector
    assert any(t.key == POOL and t.effect == "NoSchedule" for t in pod.spec.tolerations)
    assert pod.spec.service_account_name == "trainer" and pod.spec.priority == 1000
    assert f"dataset: {DATASET}" in log, log[-2000:]


def steps(text: str) -> list[tuple[int, str]]:
    """(step, loss) in the order the log printed them."""
    return [(int(m.group(1)), m.group(2)) for line in text.splitlines()
            if (m := STEP_LINE.match(line.strip()))]


def resumed_at(text: str, restored: int) -> bool:
    """The log's last restore is of step `restored` and the next step it ran is its successor:
    it went on from the restored state, no step before it ran again."""
    found = list(re.finditer(r"^restored step (\d+) .*\n(?:.*\n)*?step (\d+) loss", text, re.M))
    return bool(found) and (int(found[-1].group(1)), int(found[-1].group(2))) == (
        restored, restored + 1)


def recovery_after(custom: client.CustomObjectsApi, epoch: int, name: str = TRAINING
                   ) -> dict[str, Any] | None:
    last = status_of(custom, name).get("lastRecovery") or {}
    return last if last.get("epoch", 0) > epoch and last.get("completionTime") else None


def workers(core: client.CoreV1Api, job: str, operator_node: str
            ) -> tuple[dict[str, Any], str, str]:
    """The job's pods by name; the one to lose (on a node without the operator: one always
    is) and the one that stays."""
    pods = {p.metadata.name: p for p in core.list_namespaced_pod(
        "default", label_selector=f"{naming.LABEL_JOB}={job}").items}
    lost = next(n for n, p in sorted(pods.items(), reverse=True)
                if p.spec.node_name != operator_node)
    (kept,) = set(pods) - {lost}
    return pods, lost, kept


def all_resumed_at(core: client.CoreV1Api, pods: Iterable[str], restored: int,
                   timeout: float = 120) -> None:
    """Wait until every pod's trainer went on from the restored step (`resumed_at`)."""
    for pod in pods:
        wait_until(lambda p=pod: resumed_at(trainer_log(core, p), restored), timeout,
                   f"{pod} to step on from the restored step")


def succeeds_as_uninterrupted(custom: client.CustomObjectsApi, core: client.CoreV1Api,
                              name: str, pod: str, reference: dict[int, str]) -> None:
    """The job ends Succeeded and `pod` printed an uninterrupted run's losses."""
    final = finished(custom, name)
    assert final["state"] == "Succeeded", final
    assert_losses(core, pod, reference)


def newest_step(core: client.CoreV1Api, pod: str) -> int:
    return max((s for s, _ in steps(trainer_log(core, pod))), default=0)


def assert_losses(core: client.CoreV1Api, pod: str, reference: dict[int, str]) -> None:
    printed = steps(trainer_log(core, pod))
    got = dict(printed)
    assert all(got[s] == loss_hex for s, loss_hex in printed), "a re-run step's loss changed"
    assert got == reference, f"{pod}'s losses differ from the uninterrupted run: {got}"


def held_replicas(core: client.CoreV1Api, job: str, pod: str, newer_than: int) -> set[int]:
    """Ranks whose complete replica newer than step `newer_than` the pod's sidecar holds
    (its /inventory over the pod network, with the job's token); empty while it does not
    answer."""
    found = core.read_namespaced_pod(pod, "default")
    token = job_token(core, job)
    try:  # signed with the job token (issue 45: no token on the wire)
        inventory = ControlClient(found.status.pod_ip, sidecar_port(found), token,
                                  timeout=2).call_json("/inventory")
    except ControlError:
        return set()
    return {int(r["rank"]) for r in inventory.get("replicas") or ()
            if r.get("complete") and int(r["version"]) > newer_than}
