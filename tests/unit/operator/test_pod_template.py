"""spec.template as a pod template (v1beta1): the trainer container is wrapped by the operator,
everything else passes through to the worker pods (and what decides placement to the spare
placeholders), and what collides with the operator's own parts is refused naming the field."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from gemini_operator.core import naming, render
from gemini_operator.core.pod_template import OPERATOR_ENV_NAMES, operator_sets
from gemini_operator.core.spares import spare_pod
from gemini_operator.core.spec import SpecError, parse_spec
from tests.unit.operator.builders import make_job

JOB = render.JobRef("train", "ml", "uid-1")
CONFIG = render.RenderConfig()
GPU_NODES = {"gpu.example.com/pool": "h200"}
TAINT = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
ZONE_AFFINITY = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
    "nodeSelectorTerms": [{"matchExpressions": [
        {"key": "topology.kubernetes.io/zone", "operator": "In", "values": ["a", "b"]}]}]}}}
TEMPLATE: dict[str, Any] = {
    "metadata": {"labels": {"team": "llm"}, "annotations": {"owner": "ml-infra"}},
    "spec": {
        "nodeSelector": GPU_NODES,
        "tolerations": [TAINT],
        "affinity": ZONE_AFFINITY,
        "serviceAccountName": "trainer",
        "priorityClassName": "research-high",
        "schedulerName": "volcano",
        "imagePullSecrets": [{"name": "registry"}],
        "hostNetwork": True,
        "securityContext": {"fsGroup": 1000, "runAsUser": 1000},
        "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": "datasets"}},
                    {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "64Gi"}}],
        "initContainers": [{"name": "fetch-tokenizer", "image": "busybox", "command": ["true"]}],
        "containers": [
            {"name": "log-shipper", "image": "fluent-bit"},
            {"name": "trainer", "image": "ghcr.io/acme/llm:1", "command": ["python", "train.py"],
             "args": ["--steps", "100"], "env": [{"name": "HF_HOME", "value": "/data/hf"}],
             "resources": {"limits": {"nvidia.com/gpu": 8, "rdma/ib": 1, "memory": "1Ti"}},
             "volumeMounts": [{"name": "data", "mountPath": "/data"},
                              {"name": "dshm", "mountPath": "/dev/shm"}],
             "ports": [{"name": "metrics", "containerPort": 9400}],
             "securityContext": {"capabilities": {"add": ["IPC_LOCK"]}}},
        ],
    },
}


def spec_with(template: dict[str, Any]) -> Any:
    return parse_spec(make_job().set("template", template).spec(), "gemini:side")


def worker() -> dict[str, Any]:
    return render.worker_pod(JOB, spec_with(copy.deepcopy(TEMPLATE)), 1, 0, CONFIG)


def container(pod: dict[str, Any], name: str, kind: str = "containers") -> dict[str, Any]:
    return next(c for c in pod["spec"][kind] if c["name"] == name)


def test_the_trainer_container_is_wrapped_and_its_fields_kept() -> None:
    spec = spec_with(copy.deepcopy(TEMPLATE))
    assert spec.template.image == "ghcr.io/acme/llm:1"
    assert spec.template.resources.limits["nvidia.com/gpu"] == "8"
    assert spec.template.run_as.user == 1000
    trainer = container(worker(), "trainer")
    assert trainer["command"][-2:] == ["python", "train.py"]
    assert trainer["command"][: len(CONFIG.launcher_command)] == list(CONFIG.launcher_command)
    assert trainer["args"] == ["--steps", "100"]
    assert trainer["resources"]["limits"] == {"nvidia.com/gpu": "8", "rdma/ib": "1",
                                              "memory": "1Ti"}
    assert [m["mountPath"] for m in trainer["volumeMounts"]] == [
        CONFIG.shm_mount_path, "/data", "/dev/shm"]
    assert [p["name"] for p in trainer["ports"]] == ["rendezvous", "launcher", "metrics"]
    env = {e["name"] for e in trainer["env"]}
    assert {"HF_HOME", "MASTER_ADDR", "GEMINI_RANK"} <= env
    assert trainer["securityContext"]["capabilities"] == {"add": ["IPC_LOCK"]}
    assert trainer["securityContext"]["allowPrivilegeEscalation"] is False


def test_pod_fields_pass_through_and_lists_are_joined() -> None:
    pod = worker()
    spec = pod["spec"]
    assert spec["nodeSelector"] == GPU_NODES and spec["tolerations"] == [TAINT]
    assert spec["serviceAccountName"] == "trainer"
    assert spec["priorityClassName"] == "research-high"  # the user's, not the default
    assert spec["schedulerName"] == "volcano" and spec["hostNetwork"] is True
    assert spec["imagePullSecrets"] == [{"name": "registry"}]
    assert [v["name"] for v in spec["volumes"]] == ["data", "dshm", naming.SHM_VOLUME]
    assert [c["name"] for c in spec["initContainers"]] == ["fetch-tokenizer",
                                                           naming.SIDECAR_CONTAINER]
    assert [c["name"] for c in spec["containers"]] == ["trainer", "log-shipper"]
    assert spec["securityContext"] == {"runAsNonRoot": True, "runAsUser": 1000,
                                       "seccompProfile": {"type": "RuntimeDefault"},
                                       "fsGroup": 1000}
    assert spec["hostname"] == "train-worker-1" and spec["restartPolicy"] == "OnFailure"
    labels = pod["metadata"]["labels"]
    assert labels["team"] == "llm" and labels[naming.LABEL_RANK] == "1"
    assert pod["metadata"]["annotations"] == {"owner": "ml-infra"}


def test_the_users_affinity_is_kept_and_one_worker_per_node_added() -> None:
    affinity = worker()["spec"]["affinity"]
    assert affinity["nodeAffinity"] == ZONE_AFFINITY["nodeAffinity"]
    (term,) = affinity["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term == render.one_pod_per_node("train")["podAntiAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"][0]


def test_a_spare_placeholder_is_placed_as_a_worker_would_be_and_runs_nothing_else() -> None:
    pod = spare_pod(JOB, spec_with(copy.deepcopy(TEMPLATE)), 0, CONFIG)
    spec = pod["spec"]
    assert spec["nodeSelector"] == GPU_NODES and spec["tolerations"] == [TAINT]
    assert spec["priorityClassName"] == "research-high"
    assert "nodeAffinity" in spec["affinity"] and "podAntiAffinity" in spec["affinity"]
    assert "volumes" not in spec and len(spec["containers"]) == 1
    hold = spec["containers"][0]
    assert hold["resources"]["limits"]["nvidia.com/gpu"] == "8"  # it holds the GPUs' place


def _refused(change: Any) -> SpecError:
    template = copy.deepcopy(TEMPLATE)
    change(template)
    with pytest.raises(SpecError) as err:
        spec_with(template)
    return err.value


def _trainer(template: dict[str, Any]) -> dict[str, Any]:
    return template["spec"]["containers"][1]


@pytest.mark.parametrize(("change", "field", "words"), [
    (lambda t: _trainer(t).update(name="main"), "spec.template.spec.containers",
     "no container named 'trainer'"),
    (lambda t: _trainer(t).pop("command"), "spec.template.spec.containers[1].command",
     "is required"),
    (lambda t: t["spec"]["containers"][0].update(name=naming.SIDECAR_CONTAINER),
     "spec.template.spec.containers[0].name", "checkpoint sidecar"),
    (lambda t: t["spec"]["volumes"][0].update(name=naming.SHM_VOLUME),
     "spec.template.spec.volumes[0].name", "checkpoint memory volume"),
    (lambda t: t["spec"].update(restartPolicy="Never"), "spec.template.spec.restartPolicy",
     "OnFailure"),
    (lambda t: t["spec"].update(hostname="x"), "spec.template.spec.hostname", "remove it"),
    (lambda t: _trainer(t)["env"].append({"name": "MASTER_ADDR", "value": "x"}),
     "spec.template.spec.containers[1].env[1].name", "MASTER_ADDR is set by the operator"),
    (lambda t: _trainer(t)["env"].append({"name": "GEMINI_RANK", "value": "x"}),
     "spec.template.spec.containers[1].env[1].name", "GEMINI_RANK is set by the operator"),
    (lambda t: _trainer(t)["ports"].append({"name": "launcher", "containerPort": 1}),
     "spec.template.spec.containers[1].ports[1].name", "port the operator opens"),
    (lambda t: t["metadata"]["labels"].update({naming.LABEL_RANK: "0"}),
     f"spec.template.metadata.labels.{naming.LABEL_RANK}", "label the operator sets"),
])
def test_what_collides_with_the_operators_parts_is_refused_naming_the_field(
        change: Any, field: str, words: str) -> None:
    err = _refused(change)
    assert err.field_path == field and words in err.message, str(err)


@pytest.mark.parametrize("standby", [False, True])
@pytest.mark.parametrize("procs", [1, 2])
def test_the_reserved_environment_is_what_the_operator_sets(standby: bool, procs: int) -> None:
    builder = make_job().set("numProcPerNode", procs).set("failurePolicy.warmStandby", standby)
    spec = parse_spec(builder.spec(), "gemini:side")
    pod = render.worker_pod(JOB, spec, 0, 0, CONFIG)
    rendered = {e["name"] for e in container(pod, "trainer")["env"]}
    assert all(operator_sets(name) for name in rendered), rendered
    if procs == 1:
        assert rendered >= OPERATOR_ENV_NAMES


def test_a_v1alpha1_template_renders_as_before() -> None:
    spec = parse_spec(make_job().spec(), "gemini:side")
    pod = render.worker_pod(JOB, spec, 0, 0, CONFIG)
    assert "nodeSelector" not in pod["spec"] and "annotations" not in pod["metadata"]
    assert [c["name"] for c in pod["spec"]["containers"]] == ["trainer"]
