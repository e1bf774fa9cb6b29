"""Worker pods against the real API server's PodSecurity admission: a default GeminiJob's pods
are admitted under `restricted` and run on the local cluster with their probes; a root trainer
needs `baseline`. Each job's NetworkPolicy is created and accepted (the local cluster does not
enforce NetworkPolicies: the rendered policy is checked in tests/unit)."""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from gemini_operator.core import naming, render, spares
from gemini_operator.core.spec import parse_spec
from tests.cluster.test_operator import Jobs, wait_for
from tests.fixtures.operator import OperatorThread
from tests.unit.operator.builders import make_job

pytestmark = pytest.mark.cluster

ENFORCE = "pod-security.kubernetes.io/enforce"
# No PriorityClass: dry runs need no operator to have made one.
DRY_CONFIG = render.RenderConfig(worker_priority_class="", spare_priority_class="")


@pytest.fixture
def pod_security_namespace(kube_api: client.ApiClient) -> Iterator[Callable[[str], str]]:
    """Namespaces enforcing a Pod Security level, with their default ServiceAccount."""
    core = client.CoreV1Api(kube_api)
    made: list[str] = []

    def make(level: str) -> str:
        name = f"ps-{level[:4]}-{uuid.uuid4().hex[:8]}"
        body: Any = {"metadata": {"name": name, "labels": {ENFORCE: level}}}
        core.create_namespace(body)
        made.append(name)
        wait_for(lambda: _has_default_account(core, name), 20, f"default ServiceAccount in {name}")
        return name

    yield make
    for name in made:
        with contextlib.suppress(ApiException):
            client.CustomObjectsApi(kube_api).delete_collection_namespaced_custom_object(
                naming.GROUP, naming.VERSION, name, naming.PLURAL)
        with contextlib.suppress(ApiException):
            core.delete_namespace(name)


def _has_default_account(core: client.CoreV1Api, namespace: str) -> bool:
    try:
        core.read_namespaced_service_account("default", namespace)
        return True
    except ApiException:
        return False


def _dry_run_pods(core: client.CoreV1Api, namespace: str, template: dict[str, Any] | None
                  ) -> None:
    """Create a worker and a spare placeholder as rendered, server-side dry run (admission
    runs, nothing is stored); raises the API server's refusal."""
    builder = make_job("dry")
    if template:
        builder = builder.set("template.securityContext", template)
    spec = parse_spec(builder.spec(), "gemini:test")
    job = render.JobRef("dry", namespace, str(uuid.uuid4()))
    for pod in (render.worker_pod(job, spec, 0, 0, DRY_CONFIG),
                spares.spare_pod(job, spec, 0, DRY_CONFIG)):
        pod["metadata"].pop("ownerReferences")  # the owner does not exist
        core.create_namespaced_pod(namespace, pod, dry_run="All")


def test_default_worker_and_spare_pods_are_admitted_under_restricted(
    kube_api: client.ApiClient, pod_security_namespace: Callable[[str], str],
) -> None:
    namespace = pod_security_namespace("restricted")
    _dry_run_pods(client.CoreV1Api(kube_api), namespace, None)
    _dry_run_pods(client.CoreV1Api(kube_api), namespace, {"runAsUser": 1000, "runAsGroup": 1000})


def test_a_root_trainer_needs_baseline(
    kube_api: client.ApiClient, pod_security_namespace: Callable[[str], str],
) -> None:
    core = client.CoreV1Api(kube_api)
    with pytest.raises(ApiException) as refused:
        _dry_run_pods(core, pod_security_namespace("restricted"), {"runAsUser": 0})
    assert refused.value.status == 403
    message = json.loads(refused.value.body)["message"]
    assert 'violates PodSecurity "restricted:latest"' in message, message
    for rule in ("runAsNonRoot != true", "runAsUser=0", "unrestricted capabilities"):
        assert rule in message, message
    assert '"gemini-sidecar"' not in message, message  # only the trainer is root
    _dry_run_pods(core, pod_security_namespace("baseline"), {"runAsUser": 0})


def test_a_default_geminijob_runs_in_a_restricted_namespace_behind_its_network_policy(
    local_cluster: Any, gemini_operator: OperatorThread, kube_api: client.ApiClient,
    pod_security_namespace: Callable[[str], str],
) -> None:
    namespace = pod_security_namespace("restricted")
    jobs = Jobs(kube_api, namespace)
    command = ["python", "-c", "import time; time.sleep(600)"]
    jobs.create(make_job("fenced").with_nodes(2).set("template.command", command).obj())
    job = wait_for(lambda: jobs.get("fenced") if len(jobs.pods("fenced")) == 2 else None, 60,
                   "both worker pods admitted and created")
    networking = client.NetworkingV1Api(kube_api)
    policy: Any = wait_for(lambda: _policy(networking, namespace, "fenced"), 30,
                           "the job's NetworkPolicy")
    (owner,) = policy.metadata.owner_references
    assert (owner.kind, owner.name, owner.uid) == ("GeminiJob", "fenced", job["metadata"]["uid"])
    assert policy.spec.pod_selector.match_labels == naming.worker_selector("fenced")
    # The sidecar's startup probe passes (the trainer starts after it), readiness follows.
    wait_for(lambda: jobs.state("fenced") == "Running" and _all_ready(jobs.pods("fenced")), 90,
             "both workers Running and Ready")
    # Liveness probes every 10 s, 3 failures to restart: healthy sidecars must not restart.
    time.sleep(35)
    for pod in jobs.pods("fenced"):
        statuses = [*(pod.status.init_container_statuses or []),
                    *(pod.status.container_statuses or [])]
        assert {s.name: s.restart_count for s in statuses} == {
            naming.SIDECAR_CONTAINER: 0, naming.TRAINER_CONTAINER: 0}, pod.metadata.name
        assert all(s.ready for s in statuses), pod.metadata.name
    jobs.delete("fenced")


def _policy(api: client.NetworkingV1Api, namespace: str, job: str) -> Any:
    try:
        return api.read_namespaced_network_policy(naming.network_policy_name(job), namespace)
    except ApiException as err:
        if err.status == 404:
            return None
        raise


def _all_ready(pods: list[Any]) -> bool:
    return bool(pods) and all(
        any(c.type == "Ready" and c.status == "True" for c in pod.status.conditions or [])
        for pod in pods)
