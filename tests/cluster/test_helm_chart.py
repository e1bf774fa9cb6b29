"""The chart against the real API server: every rendered object passes a server-side dry-run
(strict field validation, RBAC, admission), `helm install` refuses a monitor whose API the
cluster does not serve, and a real install on the local cluster runs a GeminiJob to completion
with the chart's RBAC, then uninstalls cleanly."""

from __future__ import annotations

import subprocess
import urllib.request
import uuid
from collections.abc import Callable
from typing import Any

import pytest
import yaml
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from gemini_local.controlplane import ControlPlane, binaries_dir
from gemini_operator.core import naming
from tests.fixtures.helm import CHART, Helm
from tests.fixtures.nodes import LocalCluster, wait_until
from tests.unit.operator.builders import make_job

pytestmark = pytest.mark.cluster

VALUE_SETS = [
    pytest.param([], id="default values"),
    pytest.param(["--set", "replicaCount=3,operator.watchNamespace=team-a,"
                  "operator.logLevel=DEBUG,crds.keep=false"],
                 id="three replicas watching one namespace"),
    pytest.param(["--set", "crds.install=false,dashboards.enabled=false,"
                  "metrics.service.type=NodePort,serviceAccount.name=gemini-op,"
                  "serviceAccount.annotations.team=ml"],
                 id="CRD managed elsewhere, named service account"),
    pytest.param(["--set", "image.digest=sha256:" + "0" * 64,
                  "--set-json", 'imagePullSecrets=[{"name":"registry"}]',
                  "--set-json", 'tolerations=[{"key":"gpu","operator":"Exists"}]',
                  "--set-json", 'nodeSelector={"kubernetes.io/os":"linux"}',
                  "--set-json", 'operator.extraEnv=[{"name":"X","value":"1"}]'],
                 id="digest, pull secrets, scheduling and extra env"),
]


def kubectl(plane: ControlPlane, *args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(binaries_dir() / "kubectl"), "--kubeconfig", str(plane.kubeconfig), *args],
        input=stdin, capture_output=True, text=True, timeout=120, check=False)


@pytest.mark.parametrize("values", VALUE_SETS)
def test_rendered_manifests_pass_a_server_side_dry_run(
    helm: Helm, control_plane: ControlPlane, namespace: str, values: list[str],
):
    rendered = helm.template_text("--namespace", namespace, *values)
    kinds = [d["kind"] for d in yaml.safe_load_all(rendered) if d]
    result = kubectl(control_plane, "apply", "--server-side", "--dry-run=server",
                     "--validate=strict", "--field-manager=helm-chart-test", "-f", "-",
                     stdin=rendered)
    assert result.returncode == 0, result.stderr
    # One line per object, e.g. "deployment.apps/gemini-gemini-operator serverside-applied
    # (server dry run)".
    applied = [ln for ln in result.stdout.splitlines() if ln.endswith("(server dry run)")]
    assert len(applied) == len(kinds), result.stdout


def test_a_monitor_is_refused_by_helm_install_when_the_cluster_lacks_its_api(
    helm: Helm, control_plane: ControlPlane, namespace: str,
):
    result = helm.run(["install", "monitored", str(CHART), "--namespace", namespace,
                       "--dry-run=server", "--set", "serviceMonitor.enabled=true"],
                      kubeconfig=control_plane.kubeconfig)
    assert result.returncode != 0
    assert "does not serve monitoring.coreos.com/v1 ServiceMonitor" in result.stderr
    # Without the monitor the same install renders against the live cluster.
    result = helm.run(["install", "plain", str(CHART), "--namespace", namespace,
                       "--dry-run=server", "--set", "crds.install=false"],
                      kubeconfig=control_plane.kubeconfig)
    assert result.returncode == 0, result.stderr
    assert "kind: Deployment" in result.stdout


# --- a real install on the local cluster --------------------------------------------------------

def _adopt_crd(kube_api: client.ApiClient, release: str, namespace: str) -> None:
    """Let the release take over the CRD the session already applied with kubectl (the
    migration docs/install.md describes): Helm adopts objects carrying its ownership marks."""
    client.ApiextensionsV1Api(kube_api).patch_custom_resource_definition(
        "geminijobs.gemini.io",
        {"metadata": {"labels": {"app.kubernetes.io/managed-by": "Helm"},
                      "annotations": {"meta.helm.sh/release-name": release,
                                      "meta.helm.sh/release-namespace": namespace}}})


def _new_namespace(core: client.CoreV1Api, prefix: str) -> str:
    name = f"{prefix}-{uuid.uuid4().hex[:8]}"
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name)))
    wait_until(lambda: _exists(lambda: core.read_namespaced_service_account("default", name)),
               20, f"the default ServiceAccount of {name}")
    return name


def _exists(read: Callable[[], object]) -> bool:
    try:
        read()
        return True
    except ApiException as err:
        if err.status == 404:
            return False
        raise


# Runs before tests/cluster/test_operator.py (file order): that module's in-process operator
# watches every namespace and would reconcile this job too once started.
def test_helm_install_runs_a_job_to_completion_and_uninstall_cleans_up(
    helm: Helm, local_cluster: LocalCluster, gemini_crd: dict[str, Any],
):
    api, core = local_cluster.api, local_cluster.core
    release, kubeconfig = "gemini", local_cluster.kubeconfig
    system, jobs_ns = _new_namespace(core, "gemini-system"), _new_namespace(core, "jobs")
    try:
        _adopt_crd(api, release, system)
        result = helm.run(["install", release, str(CHART), "--namespace", system, "--wait",
                           "--timeout", "120s", "--set", f"operator.watchNamespace={jobs_ns}"],
                          kubeconfig=kubeconfig, timeout=180)
        assert result.returncode == 0, result.stderr + _operator_diagnosis(core, system)
        assert "kubectl -n " + system in result.stdout  # NOTES.txt

        # The operator pod is Ready (its probes pass) and leads through a Lease in its own
        # namespace (the Role the chart grants).
        (pod,) = core.list_namespaced_pod(
            system, label_selector="app.kubernetes.io/instance=gemini").items
        assert pod.status is not None and pod.status.pod_ip
        pod_ip = str(pod.status.pod_ip)
        wait_until(lambda: _lease_holder(api, system), 30, "a Lease holder")
        wait_until(lambda: "gemini_operator_leader 1.0" in _scrape(pod_ip, 9090), 30,
                   "the operator to report that it leads")
        # GeminiJobs in the default roles, by the controller manager's aggregation (issue 44)
        rbac = client.RbacAuthorizationV1Api(api)
        for role, verb in (("view", "watch"), ("edit", "create"), ("admin", "delete")):
            wait_until(lambda r=role, v=verb: _grants(rbac, r, "geminijobs", v), 30,
                       f"the {role} role to cover GeminiJobs")

        body = make_job("done", jobs_ns).with_nodes(2).set(
            "template.command", ["python", "-c", "print('trained')"]).obj()
        custom = client.CustomObjectsApi(api)
        custom.create_namespaced_custom_object(naming.GROUP, naming.VERSION, jobs_ns,
                                               naming.PLURAL, body)
        state = wait_until(lambda: _state_if_finished(custom, jobs_ns, "done"), 180,
                           "the GeminiJob to finish")
        assert state == "Succeeded"

        # The gauge follows the status write.
        wait_until(lambda: 'gemini_operator_jobs{state="Succeeded"} 1.0'
                   in _scrape(pod_ip, 9090), 10, "the metrics to count the job")

        result = helm.run(["uninstall", release, "--namespace", system, "--wait",
                           "--timeout", "60s"], kubeconfig=kubeconfig, timeout=120)
        assert result.returncode == 0, result.stderr
        apps = client.AppsV1Api(api)
        assert not _exists(lambda: apps.read_namespaced_deployment("gemini-operator", system))
        assert not _exists(lambda: rbac.read_cluster_role("gemini-operator"))
        assert not _exists(lambda: rbac.read_cluster_role_binding("gemini-operator"))
        assert not core.list_namespaced_service(system).items
        # The CRD, and so every GeminiJob, is kept.
        assert custom.get_namespaced_custom_object(naming.GROUP, naming.VERSION, jobs_ns,
                                                   naming.PLURAL, "done")
    finally:
        helm.run(["uninstall", release, "--namespace", system], kubeconfig=kubeconfig)
        core.delete_namespace(jobs_ns)
        core.delete_namespace(system)


def _grants(rbac: client.RbacAuthorizationV1Api, role: str, resource: str, verb: str) -> bool:
    rules = rbac.read_cluster_role(role).rules or []
    return any(resource in (r.resources or []) and verb in (r.verbs or [])
               and naming.GROUP in (r.api_groups or []) for r in rules)


def _operator_diagnosis(core: client.CoreV1Api, namespace: str) -> str:
    """The operator pods' status and logs, for a failure message."""
    out = []
    for pod in core.list_namespaced_pod(namespace).items:
        name = str(pod.metadata.name if pod.metadata else "")
        status = pod.status.container_statuses if pod.status else None
        out.append(f"\npod {name}: {status}")
        try:
            out.append(core.read_namespaced_pod_log(name, namespace, tail_lines=40))
        except ApiException as err:
            out.append(f"(no logs: {err.reason})")
    return "\n".join(out)


def _lease_holder(api: client.ApiClient, namespace: str) -> str | None:
    leases = client.CoordinationV1Api(api).list_namespaced_lease(namespace).items
    holders = [lease.spec.holder_identity for lease in leases if lease.spec]
    return next((h for h in holders if h), None)


def _state_if_finished(custom: client.CustomObjectsApi, namespace: str, name: str) -> str | None:
    job: dict[str, Any] = custom.get_namespaced_custom_object(  # type: ignore[assignment]
        naming.GROUP, naming.VERSION, namespace, naming.PLURAL, name)
    state = (job.get("status") or {}).get("state")
    return state if state in ("Succeeded", "Failed") else None


def _scrape(host: str, port: int) -> str:
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=5) as response:
        return str(response.read().decode())
