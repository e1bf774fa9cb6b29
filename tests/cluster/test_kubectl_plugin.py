"""`kubectl gemini` through the real kubectl and the real API server of the local cluster.

No operator runs here: the test plays its part. It creates a GeminiJob, one worker pod per
rank on the four real nodes (labelled as the operator labels them, running `sleep`), and
writes a realistic status (the placement computed by the operator's own code from the pods'
nodes and labels, checkpoint steps, a recovery) through the status subresource. kubectl
finds the plugin on PATH (the project's .venv/bin) as any user's kubectl would.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client

from gemini_local.controlplane import binaries_dir
from gemini_operator.cluster.kube import KubeClient
from gemini_operator.cluster.status_store import StatusStore
from gemini_operator.core import naming
from gemini_operator.core.decide import placement_record
from gemini_operator.core.observed import node_view, pod_view
from gemini_operator.core.spec import parse_spec
from tests.fixtures.nodes import LocalCluster, wait_until
from tests.unit.operator.builders import make_job

pytestmark = pytest.mark.cluster

VENV_BIN = Path(sys.executable).parent
JOB = "train"
MEMORY_STEP, S3_STEP = 42, 40


@dataclass
class Setup:
    cluster: LocalCluster
    namespace: str
    api: client.ApiClient
    placement: dict[str, Any]

    def kubectl(self, *args: str, env: dict[str, str] | None = None, kubeconfig: bool = True
                ) -> subprocess.CompletedProcess[str]:
        flags = ["--kubeconfig", str(self.cluster.kubeconfig)] if kubeconfig else []
        environ = {**os.environ, "PATH": f"{VENV_BIN}:{os.environ.get('PATH', '')}",
                   **(env or {})}
        return subprocess.run([str(binaries_dir() / "kubectl"), *args, *flags], env=environ,
                              capture_output=True, text=True, timeout=120, check=False)

    def gemini(self, *args: str) -> subprocess.CompletedProcess[str]:
        return self.kubectl("gemini", *args, "-n", self.namespace)

    def gemini_json(self, *args: str) -> Any:
        result = self.gemini(*args, "-o", "json")
        assert result.returncode == 0, result.stderr
        return json.loads(result.stdout)


@pytest.fixture
def setup(local_cluster: LocalCluster, gemini_crd: dict[str, Any], job_namespace: str,
          kube_api: client.ApiClient) -> Iterator[Setup]:
    _wait_until_no_operator_runs(kube_api)
    custom, core = client.CustomObjectsApi(kube_api), client.CoreV1Api(kube_api)
    body = (make_job(JOB, job_namespace).with_nodes(4).with_replicas(2)
            .set("persistence", {"bucketURI": "s3://checkpoints/train"}).obj())
    job: Any = custom.create_namespaced_custom_object(naming.GROUP, naming.VERSION, job_namespace,
                                                      naming.PLURAL, body)
    for rank in range(4):
        pod: Any = _worker_pod(job, rank, f"node-{rank}")
        core.create_namespaced_pod(job_namespace, pod)
    wait_until(lambda: _all_ready(core, job_namespace), 60, "4 worker pods Ready")
    placement = _placement(kube_api, job, job_namespace)
    # Stored as the operator stores a large job's status: the per-rank maps in the ConfigMap
    # the status names (gemini.rank_detail); the plugin must read them from there.
    store = StatusStore(KubeClient(kube_api), inline_bytes=0)
    custom.patch_namespaced_custom_object_status(
        naming.GROUP, naming.VERSION, job_namespace, naming.PLURAL, JOB,
        {"status": store.stored_patch(job, _status(placement))})
    stored: Any = custom.get_namespaced_custom_object(naming.GROUP, naming.VERSION,
                                                      job_namespace, naming.PLURAL, JOB)
    assert "holders" not in stored["status"]["placement"], stored["status"]
    assert stored["status"]["rankDetail"]["configMap"] == f"{JOB}-rank-detail"
    event: Any = _event(job, job_namespace)
    core.create_namespaced_event(job_namespace, event)
    yield Setup(local_cluster, job_namespace, kube_api, placement)
    core.delete_collection_namespaced_pod(job_namespace, grace_period_seconds=0)


def test_status_shows_workers_placement_checkpoints_and_recoveries(setup: Setup) -> None:
    report = setup.gemini_json("status", JOB)
    workers = {w["rank"]: w for w in report["workers"]}
    assert sorted(workers) == [0, 1, 2, 3]
    for rank, worker in workers.items():
        node = setup.cluster.nodes[rank]
        assert (worker["pod"], worker["node"], worker["zone"], worker["rack"]) == (
            f"{JOB}-worker-{rank}", node.name, node.zone, node.rack)
        assert (worker["phase"], worker["ready"]) == ("Running", True)
    assert [g["ranks"] for g in report["placement"]["groups"]] == setup.placement["groups"]
    assert report["checkpoint"]["inMemoryStep"] == MEMORY_STEP
    assert report["checkpoint"]["persistedStep"] == S3_STEP
    assert report["replicaCoverage"]["known"] is False
    assert report["recoveries"]["count"] == 1
    assert report["recoveries"]["last"]["source"] == "Peers"
    assert [e["reason"] for e in report["recoveries"]["events"]] == ["RecoveryNeeded"]
    assert report["conditions"][0]["reason"] == "AllWorkersReady"

    table = setup.gemini("status", JOB)
    assert table.returncode == 0, table.stderr
    for expected in ("WORKERS", f"{JOB}-worker-3", "PLACEMENT  domain-aware",
                     f"newest step in memory (all ranks): {MEMORY_STEP}",
                     "NodeLost of ranks 2", "took 3.8 s", "AllWorkersReady"):
        assert expected in table.stdout, expected


def test_plan_names_replaced_ranks_and_where_every_shard_comes_from(setup: Setup) -> None:
    holders = {int(r): h for r, h in setup.placement["holders"].items()}
    report = setup.gemini_json("plan", JOB, "--fail-node", "node-0")
    # Four nodes, m=2: two disjoint holder pairs, so 2 of the 6 node pairs lose a shard.
    assert {r["failures"]: r["exact"] for r in report["randomFailures"]}[2] == "2/3"
    assert report["domainFailures"]["zone"]["survivesAnyOne"] is True
    scenario = report["scenario"]
    assert scenario["plan"]["mode"] == "memory"
    assert scenario["plan"]["version"] == MEMORY_STEP
    assert scenario["failedRanks"] == [0] and scenario["plan"]["replaceRanks"] == [0]
    peer = holders[0][1]
    sources = {r["rank"]: (r["source"], r["from"]) for r in scenario["ranks"]}
    assert sources[0] == ("peer", f"rank {peer} on node-{peer}")
    assert all(sources[r][0] == "local" for r in (1, 2, 3))

    zone = setup.gemini_json("plan", JOB, "--fail-zone", "zone-0")["scenario"]
    assert zone["plan"]["mode"] == "memory" and zone["failedRanks"] == [0, 1]

    both = setup.gemini("plan", JOB, "--fail-node", f"node-{holders[0][0]}",
                        "--fail-node", f"node-{holders[0][1]}")
    assert both.returncode == 0, both.stderr
    assert f"S3 IS NEEDED: restore everything from S3 version {S3_STEP}" in both.stdout


def test_persist_sets_the_annotation_and_says_how_to_watch(setup: Setup) -> None:
    before = datetime.now(UTC).replace(microsecond=0)
    result = setup.gemini("persist", JOB)
    assert result.returncode == 0, result.stderr
    assert f"kubectl get geminijob {JOB} -n {setup.namespace} -w" in result.stdout
    job: Any = client.CustomObjectsApi(setup.api).get_namespaced_custom_object(
        naming.GROUP, naming.VERSION, setup.namespace, naming.PLURAL, JOB)
    stamp = job["metadata"]["annotations"]["gemini.io/persist-requested"]
    requested = datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC)
    assert before <= requested <= datetime.now(UTC) + timedelta(seconds=1)
    assert stamp in setup.gemini("status", JOB).stdout


def test_errors_say_what_is_wrong(setup: Setup) -> None:
    custom = client.CustomObjectsApi(setup.api)
    custom.create_namespaced_custom_object(naming.GROUP, naming.VERSION, setup.namespace,
                                           naming.PLURAL, make_job("fresh", setup.namespace).obj())
    cases = [
        (("status", "missing"), "geminijob missing not found in namespace"),
        (("plan", "fresh", "--fail-node", "node-0"), "has no placement yet"),
        (("plan", JOB, "--fail-node", "node-9"), "unknown node 'node-9'"),
        (("plan", JOB, "--fail-rack", "rack-0"), "name one as ZONE/RACK"),
        (("persist", "fresh"), "has no spec.persistence"),
    ]
    for args, message in cases:
        result = setup.gemini(*args)
        assert result.returncode == 1, (args, result.stdout)
        assert message in result.stderr, (args, result.stderr)
        assert "Traceback" not in result.stderr


def test_namespace_and_cluster_come_from_kubeconfig_resolution(setup: Setup,
                                                               tmp_path: Path) -> None:
    # $KUBECONFIG names the file, and its context's namespace is the default: no flags.
    kubeconfig = yaml.safe_load(setup.cluster.kubeconfig.read_text())
    for context in kubeconfig["contexts"]:
        context["context"]["namespace"] = setup.namespace
    path = tmp_path / "config"
    path.write_text(yaml.safe_dump(kubeconfig))
    result = setup.kubectl("gemini", "status", JOB, "-o", "json", kubeconfig=False,
                           env={"KUBECONFIG": str(path)})
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["namespace"] == setup.namespace
    listed = setup.kubectl("plugin", "list", kubeconfig=False)
    assert str(VENV_BIN / "kubectl-gemini") in listed.stdout


def _worker_pod(job: dict[str, Any], rank: int, node: str) -> dict[str, Any]:
    meta = job["metadata"]
    return {
        "metadata": {
            "name": naming.worker_pod_name(JOB, rank),
            "labels": naming.worker_labels(JOB, rank, 0),
            "ownerReferences": [{"apiVersion": naming.API_VERSION, "kind": naming.KIND,
                                 "name": meta["name"], "uid": meta["uid"],
                                 "controller": True}],
        },
        "spec": {
            "nodeName": node,
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 0,
            "containers": [{"name": naming.TRAINER_CONTAINER, "image": "x",
                            "command": ["sleep", "300"]}],
        },
    }


def _all_ready(core: client.CoreV1Api, namespace: str) -> bool:
    pods: list[Any] = core.list_namespaced_pod(namespace).items
    return len(pods) == 4 and all(
        any(c.type == "Ready" and c.status == "True" for c in p.status.conditions or ())
        for p in pods)


def _placement(api: client.ApiClient, job: dict[str, Any], namespace: str) -> dict[str, Any]:
    """status.placement exactly as the operator computes it for these pods and nodes."""
    core = client.CoreV1Api(api)
    pods = [api.sanitize_for_serialization(p) for p in core.list_namespaced_pod(namespace).items]
    views = {v.rank: v for v in map(pod_view, pods) if v is not None}
    nodes = {n.name: n for n in (node_view(api.sanitize_for_serialization(x))
                                 for x in core.list_node().items)}
    current: Any = client.CustomObjectsApi(api).get_namespaced_custom_object(
        naming.GROUP, naming.VERSION, namespace, naming.PLURAL, job["metadata"]["name"])
    return placement_record(parse_spec(current["spec"], "gemini:test"), views, nodes,
                            0).to_json()


def _status(placement: dict[str, Any]) -> dict[str, Any]:
    now = datetime.now(UTC)
    stamp = lambda delta: (now - timedelta(seconds=delta)).strftime("%Y-%m-%dT%H:%M:%SZ")  # noqa: E731
    return {
        "observedGeneration": 1, "state": "Running", "restarts": 1, "restartAttempt": 0,
        "startTime": stamp(600),
        "conditions": [{"type": "Running", "status": "True", "reason": "AllWorkersReady",
                        "message": "all 4 workers are ready", "lastTransitionTime": stamp(60),
                        "observedGeneration": 1}],
        "workers": {"total": 4, "active": 4, "ready": 4, "succeeded": 0, "failed": 0},
        "checkpoint": {"inMemoryStep": MEMORY_STEP, "persistedStep": S3_STEP,
                       "persistedTime": stamp(30)},
        "placement": placement,
        "lastRecovery": {"cause": "NodeLost", "source": "Peers", "failedRanks": [2],
                         "restoredStep": 41, "stepsLost": 1, "startTime": stamp(64),
                         "completionTime": stamp(60), "durationMilliseconds": 3800},
    }


def _event(job: dict[str, Any], namespace: str) -> dict[str, Any]:
    meta = job["metadata"]
    return {
        "metadata": {"generateName": f"{JOB}-"},
        "involvedObject": {"apiVersion": naming.API_VERSION, "kind": naming.KIND,
                           "name": meta["name"], "namespace": namespace, "uid": meta["uid"]},
        "type": "Warning", "reason": "RecoveryNeeded",
        "message": "rank 2 lost its node; restore version 41 from memory",
        "lastTimestamp": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "source": {"component": "gemini-operator"},
    }


def _wait_until_no_operator_runs(api: client.ApiClient, timeout: float = 90.0) -> None:
    """An operator started earlier in this session (e.g. the Helm chart's, now uninstalled)
    would reconcile the hand-made job and overwrite its status; this test plays the operator
    itself, so it waits until every operator lease has gone stale, and fails if one stays live."""
    deadline = time.monotonic() + timeout
    while True:
        leases: list[Any] = client.CoordinationV1Api(api).list_lease_for_all_namespaces().items
        fresh = datetime.now(UTC) - timedelta(seconds=30)
        live = [lease.metadata.name for lease in leases
                if lease.metadata.name.startswith("gemini-operator")
                and lease.spec.renew_time and lease.spec.renew_time > fresh]
        if not live:
            return
        if time.monotonic() > deadline:
            pytest.fail(f"an operator still renews lease(s) {live}; stop it before this test")
        time.sleep(2)
