"""Spare nodes on the real local cluster: a GeminiJob with failurePolicy.spareNodes=1 on
exactly workers+1 schedulable nodes holds the free node with a placeholder pod; when a worker's
node is lost, the real kube-scheduler preempts the placeholder for the replacement worker (no
free node is needed), the operator makes the placeholder again, which waits Pending and says
so in status.spares, and takes the next node that joins. Suspending removes the placeholder.

The trainer is a sleep (recovery then restarts it from step 0): what is tested is placement and
preemption, not training (tests/cluster/test_operator_recovery.py covers restoring)."""

from __future__ import annotations

import time
from typing import Any

import pytest
from kubernetes import client

from gemini_local import faults
from gemini_operator.core import naming
from tests.cluster.test_operator import Jobs, wait_for
from tests.fixtures.operator import OperatorThread
from tests.unit.operator.builders import make_job

pytestmark = pytest.mark.cluster

NAME = "held"
SPARE = naming.spare_pod_name(NAME, 0)
ENV = [{"name": "OMP_NUM_THREADS", "value": "1"}]


def schedulable_nodes(core: client.CoreV1Api) -> list[str]:
    """Ready nodes that take new pods (no NoSchedule/NoExecute taint, not cordoned)."""
    names = []
    node: Any
    for node in core.list_node().items:
        ready = any(c.type == "Ready" and c.status == "True"
                    for c in (node.status.conditions or []))
        tainted = any(t.effect in ("NoSchedule", "NoExecute") for t in (node.spec.taints or []))
        if ready and not tainted and not node.spec.unschedulable:
            names.append(str(node.metadata.name))
    return sorted(names)


def spare_pod(jobs: Jobs) -> Any:
    return next((p for p in jobs.pods(NAME) if p.metadata.name == SPARE), None)


def worker_nodes(jobs: Jobs) -> dict[str, str]:
    return {p.metadata.name: p.spec.node_name for p in jobs.pods(NAME)
            if p.metadata.labels.get(naming.LABEL_ROLE) == naming.ROLE_WORKER}


def spares_status(jobs: Jobs) -> dict[str, Any]:
    return dict(((jobs.get(NAME) or {}).get("status") or {}).get("spares") or {})


def unschedulable(pod: Any) -> bool:
    return pod is not None and any(
        c.type == "PodScheduled" and c.status == "False" and c.reason == "Unschedulable"
        for c in (pod.status.conditions or []))


def preempted_events(jobs: Jobs) -> list[Any]:
    """The scheduler's events on the placeholder pod saying it preempted it."""
    events = jobs.core.list_namespaced_event(
        jobs.ns, field_selector=f"involvedObject.name={SPARE}").items
    return [e for e in events if e.reason == "Preempted"]


def test_a_replacement_preempts_the_spare_placeholder_and_the_placeholder_waits_for_a_node(
    local_cluster: Any, gemini_operator: OperatorThread, kube_api: client.ApiClient,
    job_namespace: str,
) -> None:
    jobs = Jobs(kube_api, job_namespace)
    free = schedulable_nodes(local_cluster.core)
    workers = len(free) - 1  # exactly workers + 1 nodes: the spare takes the last one
    assert workers >= 2, f"need at least 3 schedulable nodes, have {free}"
    jobs.create(make_job(NAME).with_nodes(workers).set("failurePolicy.spareNodes", 1)
                .set("template.command", ["python", "-c", "import time; time.sleep(600)"])
                .set("template.env", ENV).obj())

    # The placeholder takes the one node no worker uses, after the workers are placed.
    held = wait_for(lambda: spares_status(jobs).get("ready") == 1 and spares_status(jobs), 120,
                    "the placeholder to hold a node")
    nodes = worker_nodes(jobs)
    (spare_node,) = held["nodes"]
    assert held["reason"] == "Held" and held["desired"] == 1
    assert spare_node not in nodes.values() and {*nodes.values(), spare_node} == set(free)
    placeholder = spare_pod(jobs)
    rank0 = next(p for p in jobs.pods(NAME) if p.metadata.name == naming.worker_pod_name(NAME, 0))
    assert placeholder.spec.priority < 0 < rank0.spec.priority
    before = wait_for(lambda: (jobs.get(NAME) or {}).get("status", {}).get("launch")
                      and jobs.get(NAME)["status"], 120, "the operator to start training")

    # Lose rank 1's node: no node is free, so the replacement must preempt the placeholder.
    lost = nodes[naming.worker_pod_name(NAME, 1)]
    old_uid = {p.metadata.name: p.metadata.uid for p in jobs.pods(NAME)}[
        naming.worker_pod_name(NAME, 1)]
    faults.lose_node(local_cluster.state_dir, lost)
    lost_at = time.monotonic()

    def replacement() -> Any:
        pod = next((p for p in jobs.pods(NAME)
                    if p.metadata.name == naming.worker_pod_name(NAME, 1)), None)
        return pod if pod is not None and pod.metadata.uid != old_uid else None

    created = wait_for(replacement, 120, "the replacement worker")
    created_at = time.monotonic()
    running = wait_for(lambda: (p := replacement()) is not None and p.status.phase == "Running"
                       and p, 60, "the replacement to run")
    running_at = time.monotonic()
    print(f"spare preemption: replacement created {created_at - lost_at:.1f} s after the node "
          f"loss, Running on the spare node {running_at - created_at:.1f} s after its creation "
          f"({running_at - lost_at:.1f} s after the loss)")
    assert running.spec.node_name == spare_node
    assert created.spec.priority > 0
    assert preempted_events(jobs), "the scheduler did not report preempting the placeholder"
    assert running_at - created_at < 30, "the replacement waited instead of preempting"

    # The placeholder is made again and waits: the lost node is down, the others are taken.
    waiting = wait_for(lambda: (p := spare_pod(jobs)) is not None
                       and p.metadata.uid != placeholder.metadata.uid and unschedulable(p)
                       and p, 60, "the placeholder to be made again and wait for a node")
    assert not waiting.spec.node_name
    short = wait_for(lambda: spares_status(jobs).get("reason") == "NoFreeNode"
                     and spares_status(jobs), 30, "status.spares to say no node is free")
    assert short["ready"] == 0 and short["nodes"] == [] and SPARE in short["message"]
    last = wait_for(lambda: ((jobs.get(NAME) or {}).get("status") or {}).get("lastRecovery"),
                    120, "the recovery to finish")
    assert last["epoch"] > before["launch"]["epoch"] and last["cause"] == "hardware", last
    reasons = {e.reason for e in jobs.events(NAME)}
    assert {"SparesCreated", "SparesHeld", "SparesUnschedulable"} <= reasons, reasons

    # A node joins: the waiting placeholder takes it (the shared nodes stay as many as before).
    joined = local_cluster.add_spare()
    held = wait_for(lambda: spares_status(jobs).get("ready") == 1 and spares_status(jobs), 60,
                    "the placeholder to hold the new node")
    assert held["nodes"] == [joined.name] and held["reason"] == "Held"

    # Suspended, the job keeps no placeholder.
    jobs.patch(NAME, {"suspend": True})
    wait_for(lambda: spare_pod(jobs) is None, 60, "the placeholder to go with the suspension")
    wait_for(lambda: "spares" not in ((jobs.get(NAME) or {}).get("status") or {}), 30,
             "status.spares to go")
    jobs.delete(NAME)
