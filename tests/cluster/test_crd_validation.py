"""The real API server refuses bad GeminiJobs with messages that say what to fix.

Every row is one manifest (or one update of a valid job) and a fragment of the message the
API server must answer with. Valid manifests come back with the schema's defaults filled in.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from gemini_operator.core import naming
from tests.unit.operator.builders import JobBuilder, make_job

pytestmark = pytest.mark.cluster

Edit = Callable[[JobBuilder], JobBuilder]
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
RULE = {"name": "oom", "action": "FailJob", "onPodFailureReasons": ["OOMKilled"]}

INVALID_ON_CREATE: list[Any] = [
    pytest.param(lambda j: j.drop("numNodes"), "spec.numNodes: Required value",
                 id="the number of nodes is required"),
    pytest.param(lambda j: j.with_nodes(0), "should be greater than or equal to 1",
                 id="a job needs at least one node"),
    pytest.param(lambda j: j.with_nodes(2.5), "spec.numNodes: Invalid value",
                 id="the number of nodes is a whole number, never a float"),
    pytest.param(lambda j: j.set("numProcPerNode", 65), "should be less than or equal to 64",
                 id="at most 64 processes per node"),
    pytest.param(lambda j: j.with_replicas(5), "should be less than or equal to 4",
                 id="at most four in-memory replicas"),
    pytest.param(lambda j: j.with_nodes(2).with_replicas(3),
                 "spec.checkpoint.replicas must be at most spec.numNodes",
                 id="replicas cannot exceed the nodes that hold them"),
    pytest.param(lambda j: j.set("checkpoint.placement", "Random"),
                 'Unsupported value: "Random"', id="placement is DomainAware or Mixed"),
    pytest.param(lambda j: j.set("checkpoint.trafficScheduling", "Later"),
                 'Unsupported value: "Later"', id="traffic scheduling is Interleaved or Immediate"),
    pytest.param(lambda j: j.set("checkpoint.intervalIterations", 0),
                 "should be greater than or equal to 1", id="checkpoint at least every iteration"),
    pytest.param(lambda j: j.set("checkpoint.memoryBudgetPerNode", "lots"),
                 "spec.checkpoint.memoryBudgetPerNode", id="the memory budget is a quantity"),
    pytest.param(lambda j: j.drop("template.image"), "give spec.template as a pod template",
                 id="the trainer needs an image"),
    pytest.param(lambda j: j.set("template.spec", {"containers": [{"name": "trainer"}]}),
                 "or the deprecated v1alpha1 fields image and command, not both",
                 id="a template is a pod template or the v1alpha1 fields, not both"),
    pytest.param(lambda j: j.set("template", {"spec": {"containers": [{"name": "main",
                                                                        "image": "x"}]}}),
                 "needs a container named trainer", id="a pod template names its trainer"),
    pytest.param(lambda j: j.set("template", {"spec": {"containers": []}}),
                 "should have at least 1 items", id="a pod template has containers"),
    pytest.param(lambda j: j.set("template.command", []), "should have at least 1 items",
                 id="the trainer needs a command"),
    pytest.param(lambda j: j.set("template.image", "x" * 600), "Too long",
                 id="an image reference is at most 512 characters"),
    pytest.param(lambda j: j.set("template.env", [{"name": "GEMINI_RANK", "value": "3"}]),
                 "env names starting with GEMINI_ or PET_ are set by the operator",
                 id="user env cannot override the operator's GEMINI_ variables"),
    pytest.param(lambda j: j.set("template.env", [{"name": "MASTER_ADDR", "value": "x"}]),
                 "are set by the operator; remove the entry",
                 id="user env cannot override the rendezvous variables"),
    pytest.param(lambda j: j.set("template.env", [{"name": "A", "value": "1"},
                                                  {"name": "A", "value": "2"}]),
                 "Duplicate value", id="env names are unique"),
    pytest.param(lambda j: j.set("template.env", [
        {"name": "A", "value": "1", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}]),
                 "an env entry sets value or valueFrom, not both",
                 id="an env entry has a value or a valueFrom, not both"),
    pytest.param(lambda j: j.set("template.resourcesPerNode",
                                 {"requests": {"memory": "2Gi"}, "limits": {"memory": "1Gi"}}),
                 "every resource limit must be at least the matching request",
                 id="limits are at least the requests"),
    pytest.param(lambda j: j.set("persistence", {"bucketURI": "https://bucket/x"}),
                 "spec.persistence.bucketURI must look like s3://bucket",
                 id="the bucket is an s3 URI"),
    pytest.param(lambda j: j.set("persistence", {"bucketURI": "s3://b/x", "endpoint": "ftp://h"}),
                 "spec.persistence.endpoint must be an http:// or https:// URL",
                 id="the S3 endpoint is an http or https URL"),
    pytest.param(lambda j: j.set("persistence", {"bucketURI": "s3://bucket/x",
                                                 "intervalSeconds": 0}),
                 "should be greater than or equal to 1", id="a pause of a second between uploads"),
    pytest.param(lambda j: j.set("failurePolicy.rules", [{"name": "x", "action": "Explode",
                                                          "onExitCodes": [1]}]),
                 'Unsupported value: "Explode"', id="rule actions are an enum"),
    pytest.param(lambda j: j.set("failurePolicy.rules", [{"name": "x", "action": "FailJob"}]),
                 "a failure policy rule needs onExitCodes or onPodFailureReasons",
                 id="a rule must say which failures it matches"),
    pytest.param(lambda j: j.set("failurePolicy.rules", [{"name": "x", "action": "FailJob",
                                                          "onExitCodes": [300]}]),
                 "should be less than or equal to 255", id="exit codes are at most 255"),
    pytest.param(lambda j: j.set("failurePolicy.rules", [RULE, RULE]), "Duplicate value",
                 id="rule names are unique"),
    pytest.param(lambda j: j.set("failurePolicy.rules", [{**RULE, "name": f"r{i}"}
                                                         for i in range(33)]),
                 "must have at most 32 items", id="at most 32 failure policy rules"),
    pytest.param(lambda j: j.set("failurePolicy.rules", [{**RULE,
                                                          "onPodFailureReasons": ["Bored"]}]),
                 'Unsupported value: "Bored"', id="pod failure reasons are an enum"),
    pytest.param(lambda j: j.set("failurePolicy.hangTimeoutSeconds", 1),
                 "should be greater than or equal to 10", id="the hang timeout is at least 10 s"),
    pytest.param(lambda j: j.set("activeDeadlineSeconds", 0),
                 "should be greater than or equal to 1", id="the active deadline is positive"),
    pytest.param(lambda j: j.set("ttlSecondsAfterFinished", -1),
                 "should be greater than or equal to 0", id="the TTL is not negative"),
    pytest.param(lambda j: j.set("metadata.name", "a" * 49),
                 "metadata.name must be at most 48 characters",
                 id="the job name leaves room for the worker pod names"),
    pytest.param(lambda j: j.set("metadata.name", "1job"),
                 "metadata.name must start with a lower-case letter",
                 id="the job name is a DNS-1035 label for its Service"),
    pytest.param(lambda j: j.set("numNode", 3), 'unknown field "spec.numNode"',
                 id="a misspelt field is refused, not ignored"),
]

INVALID_UPDATES: list[Any] = [
    pytest.param({"numNodes": 5}, "spec.numNodes is immutable",
                 id="the number of nodes never changes"),
    pytest.param({"numProcPerNode": 2}, "spec.numProcPerNode is immutable",
                 id="the processes per node never change"),
    pytest.param({"template": {"image": "python:3.12"}},
                 "spec.template can only change while the job is suspended",
                 id="the trainer template is frozen while the job runs"),
    pytest.param({"checkpoint": {"replicas": 3}},
                 "spec.checkpoint can only change while the job is suspended",
                 id="the checkpoint policy is frozen while the job runs"),
    pytest.param({"persistence": {"bucketURI": "s3://other-bucket"}},
                 "spec.persistence.bucketURI can only change",
                 id="the bucket is frozen while the job runs"),
    pytest.param({"managedBy": "kueue.x-k8s.io/multikueue"}, "spec.managedBy is immutable",
                 id="the controller that runs a job is chosen at its creation"),
]


def _custom(kube_api: client.ApiClient) -> client.CustomObjectsApi:
    return client.CustomObjectsApi(kube_api)


def _create(kube_api: client.ApiClient, namespace: str, body: dict[str, Any]) -> Any:
    body["metadata"]["namespace"] = namespace
    return _custom(kube_api).create_namespaced_custom_object(
        naming.GROUP, naming.VERSION, namespace, naming.PLURAL, body, field_validation="Strict"
    )


def _patch(kube_api: client.ApiClient, namespace: str, name: str, spec: dict[str, Any]) -> None:
    _custom(kube_api).patch_namespaced_custom_object(
        naming.GROUP, naming.VERSION, namespace, naming.PLURAL, name, {"spec": spec}
    )


def _refusal(call: Callable[[], object]) -> str:
    with pytest.raises(ApiException) as info:
        call()
    # 422: the schema or a CEL rule refused it; 400: strict decoding found an unknown field
    assert info.value.status in (400, 422), info.value.body
    return str(json.loads(info.value.body or "{}")["message"])


@pytest.mark.parametrize(("edit", "fragment"), INVALID_ON_CREATE)
def test_invalid_manifest_is_refused_with_a_clear_message(
    kube_api: client.ApiClient, gemini_crd: dict[str, Any], job_namespace: str,
    edit: Edit, fragment: str,
) -> None:
    body = edit(make_job("bad").set("persistence", {"bucketURI": "s3://bucket/x"})).obj()
    message = _refusal(lambda: _create(kube_api, job_namespace, body))
    assert fragment in message


@pytest.mark.parametrize(("spec", "fragment"), INVALID_UPDATES)
def test_update_of_a_frozen_field_is_refused(
    kube_api: client.ApiClient, gemini_crd: dict[str, Any], job_namespace: str,
    spec: dict[str, Any], fragment: str,
) -> None:
    _create(kube_api, job_namespace, make_job("frozen").set(
        "persistence", {"bucketURI": "s3://bucket/x"}).obj())
    message = _refusal(lambda: _patch(kube_api, job_namespace, "frozen", spec))
    assert fragment in message


def test_valid_minimal_manifest_gets_the_defaults(
    kube_api: client.ApiClient, gemini_crd: dict[str, Any], job_namespace: str
) -> None:
    created = _create(kube_api, job_namespace, make_job("minimal").obj())
    spec = created["spec"]
    assert spec["numProcPerNode"] == 1
    assert spec["suspend"] is False
    assert spec["checkpoint"] == {
        "replicas": 2, "placement": "DomainAware", "intervalIterations": 1,
        "trafficScheduling": "Interleaved", "peerEncryption": False,
    }
    assert spec["failurePolicy"] == {"maxRestarts": 10, "hangTimeoutSeconds": 600, "spareNodes": 0,
                                     "warmStandby": True, "inProcessRestart": True}
    assert "imagePullPolicy" not in spec["template"]  # the operator's default, in any shape
    assert "persistence" not in spec


def test_valid_full_manifest_is_accepted_and_kept(
    kube_api: client.ApiClient, gemini_crd: dict[str, Any], job_namespace: str
) -> None:
    body = (
        make_job("full").with_nodes(8).with_replicas(3)
        .set("numProcPerNode", 8)
        .set("template.env", [{"name": "LR", "value": "0.1"},
                              {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "s",
                                                                               "key": "k"}}}])
        .set("template.resourcesPerNode", {"requests": {"cpu": 4, "memory": "8Gi"},
                                           "limits": {"memory": "8Gi"}})
        .set("checkpoint.memoryBudgetPerNode", "16Gi")
        .set("checkpoint.sidecar", {"image": "gemini:dev", "resources": {"limits":
                                                                         {"memory": "20Gi"}}})
        .set("persistence", {"bucketURI": "s3://ckpt/run-1", "endpoint": "https://s3.local",
                             "credentialsSecretRef": {"name": "s3"}, "keep": 3})
        .set("failurePolicy.rules", [RULE, {"name": "bad-data", "action": "RestartJob",
                                            "onExitCodes": [3, 4]}])
        .set("activeDeadlineSeconds", 86400).set("ttlSecondsAfterFinished", 600)
        .obj()
    )
    created = _create(kube_api, job_namespace, body)
    assert created["spec"]["persistence"]["intervalSeconds"] == 3600
    assert created["spec"]["failurePolicy"]["rules"][1]["onExitCodes"] == [3, 4]
    assert created["spec"]["checkpoint"]["memoryBudgetPerNode"] == "16Gi"


def test_template_may_change_while_suspended(
    kube_api: client.ApiClient, gemini_crd: dict[str, Any], job_namespace: str
) -> None:
    _create(kube_api, job_namespace, make_job("pausable").obj())
    _patch(kube_api, job_namespace, "pausable", {"suspend": True})
    _patch(kube_api, job_namespace, "pausable", {"template": {"image": "python:3.12"},
                                             "checkpoint": {"replicas": 3}})
    _patch(kube_api, job_namespace, "pausable", {"suspend": False})
    got: Any = _custom(kube_api).get_namespaced_custom_object(
        naming.GROUP, naming.VERSION, job_namespace, naming.PLURAL, "pausable")
    assert got["spec"]["template"]["image"] == "python:3.12"
    assert got["spec"]["checkpoint"]["replicas"] == 3


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("geminijob-*.yaml")), ids=lambda p: p.name)
def test_every_example_is_accepted(
    kube_api: client.ApiClient, gemini_crd: dict[str, Any], job_namespace: str, path: Path
) -> None:
    for body in yaml.safe_load_all(path.read_text()):
        _create(kube_api, job_namespace, body)


POD_TEMPLATE = {
    "metadata": {"labels": {"team": "llm"}},
    "spec": {
        "nodeSelector": {"gpu": "h200"},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "volumes": [{"name": "data", "hostPath": {"path": "/data"}}],
        "serviceAccountName": "trainer",
        "priorityClassName": "research",
        "containers": [{"name": "trainer", "image": "python:3.11", "command": ["python", "t.py"],
                        "resources": {"limits": {"nvidia.com/gpu": 8}},
                        "volumeMounts": [{"name": "data", "mountPath": "/data"}]}],
    },
}


def test_a_pod_template_is_accepted_and_kept_whole(
    kube_api: client.ApiClient, gemini_crd: dict[str, Any], job_namespace: str
) -> None:
    created = _create(kube_api, job_namespace, make_job("pods").set("template", POD_TEMPLATE).obj())
    assert created["apiVersion"] == "gemini.io/v1beta1"
    assert created["spec"]["template"] == POD_TEMPLATE  # nothing pruned, nothing defaulted


def test_a_v1alpha1_job_is_read_whole_through_v1beta1_and_back(
    kube_api: client.ApiClient, gemini_crd: dict[str, Any], job_namespace: str
) -> None:
    old = make_job("legacy").set("template.workingDir", "/w").obj()
    old["apiVersion"], old["metadata"]["namespace"] = "gemini.io/v1alpha1", job_namespace
    _custom(kube_api).create_namespaced_custom_object(
        naming.GROUP, "v1alpha1", job_namespace, naming.PLURAL, old)
    got: Any = _custom(kube_api).get_namespaced_custom_object(
        naming.GROUP, "v1beta1", job_namespace, naming.PLURAL, "legacy")
    assert got["spec"]["template"] == old["spec"]["template"]
    _create(kube_api, job_namespace, make_job("new").set("template", POD_TEMPLATE).obj())
    back: Any = _custom(kube_api).get_namespaced_custom_object(
        naming.GROUP, "v1alpha1", job_namespace, naming.PLURAL, "new")
    assert back["spec"]["template"] == POD_TEMPLATE
