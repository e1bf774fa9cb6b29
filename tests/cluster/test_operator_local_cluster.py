"""A GeminiJob on the local cluster (nodes that run pods as processes) runs to Succeeded:
the launcher runs the command, the native sidecar starts before it and stops after it."""

from __future__ import annotations

import base64
from typing import Any

import pytest
from kubernetes import client

from gemini.control.client import ControlClient, ControlError
from tests.cluster.test_operator import Jobs, wait_for
from tests.fixtures.operator import OperatorThread
from tests.unit.operator.builders import make_job

pytestmark = pytest.mark.cluster


def test_a_trivial_job_runs_to_succeeded(
    local_cluster: Any, gemini_operator: OperatorThread, kube_api: client.ApiClient,
    job_namespace: str,
) -> None:
    jobs = Jobs(kube_api, job_namespace)
    command = ["python", "-c", "import os; print('hello from rank', os.environ['RANK'])"]
    jobs.create(make_job("hello").with_nodes(2).set("template.command", command).obj())
    wait_for(lambda: jobs.state("hello") in ("Succeeded", "Failed"), 90, "the job to finish")
    job = jobs.get("hello")
    assert job is not None
    assert job["status"]["state"] == "Succeeded", job["status"]
    assert job["status"]["workers"]["succeeded"] == 2
    assert job["status"]["completionTime"] >= job["status"]["startTime"]
    pods = jobs.pods("hello")
    assert {p.spec.node_name for p in pods} and len({p.spec.node_name for p in pods}) == 2
    for pod in pods:
        log = jobs.core.read_namespaced_pod_log(pod.metadata.name, job_namespace,
                                                container="trainer")
        assert f"hello from rank {pod.metadata.labels['gemini.io/rank']}" in log
    reasons = {e.reason for e in jobs.events("hello")}
    assert {"ChildrenCreated", "AllWorkersSucceeded"} <= reasons


# A few in-memory snapshots of a tiny model, then idle: the sidecars replicate them.
SNAPSHOTS = """
import time, torch
from gemini_trainer import Checkpointer
model = torch.nn.Linear(4, 4)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
ckpt = Checkpointer(model, optimizer, torch.optim.lr_scheduler.StepLR(optimizer, 10))
for step in range(3):
    ckpt.snapshot(step + 1)
    time.sleep(1)
time.sleep(120)
"""


def test_a_running_job_gets_a_domain_aware_placement_delivered_to_its_sidecars(
    local_cluster: Any, gemini_operator: OperatorThread, kube_api: client.ApiClient,
    job_namespace: str,
) -> None:
    jobs = Jobs(kube_api, job_namespace)
    command = ["python", "-c", SNAPSHOTS]
    jobs.create(make_job("placed").with_nodes(4).set("template.command", command).obj())
    wait_for(lambda: jobs.state("placed") == "Running", 60, "the job to run")
    placement = wait_for(lambda: jobs.status("placed").get("placement"), 10,
                         "the placement in status")
    # The session's operator keeps every job's per-rank maps beside the status.
    stored = (jobs.get("placed") or {})["status"]
    assert "holders" not in stored["placement"] and stored["rankDetail"]["ranks"] == 4
    # Published when scheduled; delivered once every sidecar took it.
    wait_for(lambda: any(c["type"] == "PlacementDelivered" and c["status"] == "True"
                         for c in (jobs.get("placed") or {})["status"].get("conditions", [])),
             30, "the placement delivered to every sidecar")
    zones = {n.metadata.name: (n.metadata.labels or {}).get("topology.kubernetes.io/zone")
             for n in local_cluster.core.list_node().items}
    for group in placement["groups"]:  # nodes 0,1 are in zone-0 and 2,3 in zone-1
        assert {zones[placement["nodes"][str(r)]] for r in group} == {"zone-0", "zone-1"}
    secret: Any = jobs.core.read_namespaced_secret("placed-peer-auth", job_namespace)
    token = base64.b64decode(secret.data["token"]).decode()
    for pod in jobs.pods("placed"):
        rank = pod.metadata.labels["gemini.io/rank"]
        inventory = _sidecar(pod, token).call_json("/inventory")
        holders = placement["holders"][rank]
        assert inventory["placement"]["send_to"] == holders[1:]
        assert set(inventory["placement"]["peers"]) >= {str(r) for r in holders[1:]}
        # the job token every pod holds cannot re-place a sidecar: only the operator's
        # signature can (it just delivered the placement above)
        body = {"peers": {}, "hold_ranks": [], "send_to": []}
        with pytest.raises(ControlError) as refused:
            _sidecar(pod, token).call_json("/peers", body)
        assert refused.value.status == 401
    # Every shard's m = 2 copies (its own and its peer's) complete: the poller counts them.
    coverage = wait_for(lambda: _full((jobs.get("placed") or {})["status"]), 120,
                        "every shard fully replicated in status.checkpoint.replicaCoverage")
    assert coverage["total"] == 4 and 1 <= coverage["step"] <= 3, coverage
    jobs.delete("placed")


def _full(status: dict[str, Any]) -> dict[str, Any] | None:
    coverage = (status.get("checkpoint") or {}).get("replicaCoverage") or {}
    return coverage if coverage.get("total") and coverage["complete"] == coverage["total"] else None


def _sidecar(pod: Any, token: str) -> ControlClient:
    """The pod's sidecar API, called signed with the job token (no token on the wire)."""
    return ControlClient(pod.status.pod_ip, 7071, token, timeout=5)
