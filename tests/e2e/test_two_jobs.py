"""Two jobs failing at the same moment recover side by side, each from the right tier: the
operator reconciles jobs concurrently and must never mix up one job's recovery with the
other's. First both trainers crash at once (restored in place from local memory), then each
job loses a node at once (a replacement fetches the shard from a peer). Each job runs on a
node pool of its own (a pod template's nodeSelector and toleration), so a node loss hits one
job only. Every recovery is checked from the trainer's own log (it restored the step the
operator chose and went on from the next one), and each job's losses equal an uninterrupted
run's."""

from __future__ import annotations

import re
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest
from kubernetes import client

from gemini_local import faults
from tests.cluster.test_operator import Jobs, wait_for
from tests.cluster.test_operator_recovery import ARGS, ENV, _recovered_after, log_texts, losses
from tests.fixtures.operator import OperatorThread
from tests.fixtures.trainers import EXAMPLE, SharedReferences
from tests.unit.operator.builders import make_job

pytestmark = [pytest.mark.cluster, pytest.mark.e2e, pytest.mark.timeout(900),
              pytest.mark.proves("two-jobs-at-once")]
POOL = "gemini.test/pool"
# Two rounds of failures need more steps than the recovery tests' 12 (the idling per step
# changes no loss).
LONGER = list(ARGS)
LONGER[LONGER.index("--steps") + 1] = "20"


@pytest.fixture(scope="module")
def reference(shared_references: SharedReferences) -> dict[int, str]:
    return shared_references(2, LONGER)


def pooled_job(name: str, pool: str) -> dict[str, Any]:
    template = {"spec": {
        "nodeSelector": {POOL: pool},
        "tolerations": [{"key": POOL, "operator": "Equal", "value": pool,
                         "effect": "NoSchedule"}],
        "containers": [{"name": "trainer", "image": "gemini:local",
                        "command": ["python", str(EXAMPLE), *LONGER], "env": ENV}]}}
    return (make_job(name).with_nodes(2).with_replicas(2).set("template", template)
            .set("failurePolicy.maxRestarts", 6).obj())


def at_once(*actions: Callable[[], object]) -> None:
    """Run the actions in threads released together."""
    gate = threading.Barrier(len(actions))

    def run(action: Callable[[], object]) -> None:
        gate.wait()
        action()

    threads = [threading.Thread(target=run, args=(a,)) for a in actions]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)


def step_of(state: Any, namespace: str, pod: str) -> int:
    return max(losses(state, namespace, pod)[0], default=0)


def assert_resumed_at(state: Any, namespace: str, pod: str, restored: int) -> None:
    """The pod's trainer log of the new epoch restored `restored`, and its first step is the
    next one (waited for: the recovery is recorded once the launchers run the new epoch,
    before the trainer has imported its libraries)."""
    def first_step() -> int | None:
        for text in reversed(log_texts(state, namespace, pod)):
            at = text.rfind(f"restored step {restored} ")
            if at >= 0:  # the same log may hold earlier epochs: look after the restore only
                found = re.search(r"^(?:\[rank\d+\]: )?step (\d+) loss", text[at:], re.M)
                return int(found.group(1)) if found else None
        return None

    first = wait_for(first_step, 180, f"{pod} to log 'restored step {restored}' and a step")
    assert first == restored + 1, (pod, restored, first)


def test_two_jobs_failing_at_the_same_moment_each_recover_from_the_right_tier(
    local_cluster: Any, gemini_operator: OperatorThread, kube_api: client.ApiClient,
    job_namespace: str, reference: dict[int, str],
) -> None:
    core, state, ns = client.CoreV1Api(kube_api), local_cluster.state_dir, job_namespace
    pools = {name: f"{name}-{uuid.uuid4().hex[:5]}" for name in ("alpha", "beta")}
    for name, pool in pools.items():  # three nodes each: two workers and a spare node
        for _ in range(3):
            node = local_cluster.add_spare(zone="zone-1" if name == "beta" else "zone-0").name
            core.patch_node(node, {"metadata": {"labels": {POOL: pool}}, "spec": {"taints": [
                {"key": POOL, "value": pool, "effect": "NoSchedule"}]}})
    jobs = Jobs(kube_api, ns)
    for name, pool in pools.items():
        jobs.create(pooled_job(name, pool))
    for name in pools:
        wait_for(lambda n=name: step_of(state, ns, f"{n}-worker-0") >= 4, 300,
                 f"{name} to reach step 4")

    # Round 1: both trainers crash at the same moment.
    before = {name: jobs.get(name)["status"] for name in pools}
    at_once(*[lambda n=name: faults.kill_container(state, ns, f"{n}-worker-1", "trainer")
              for name in pools])
    for name in pools:
        last = wait_for(lambda n=name: _recovered_after(jobs, n, before[n]), 180,
                        f"{name}'s in-place recovery")
        assert last["source"] == "Local" and last["cause"] == "software", (name, last)
        for rank in (0, 1):
            assert_resumed_at(state, ns, f"{name}-worker-{rank}", int(last["restoredStep"]))

    # Round 2: each job loses the node of its rank 1 at the same moment.
    for name in pools:
        wait_for(lambda n=name: step_of(state, ns, f"{n}-worker-0") >= 8, 300,
                 f"{name} to reach step 8")
    before = {name: jobs.get(name)["status"] for name in pools}
    lost = {name: {p.metadata.name: p for p in jobs.pods(name)}[f"{name}-worker-1"]
            for name in pools}
    at_once(*[lambda n=name: faults.lose_node(state, lost[n].spec.node_name) for name in pools])
    lost_at = time.monotonic()
    for name in pools:
        last = wait_for(lambda n=name: _recovered_after(jobs, n, before[n]), 240,
                        f"{name}'s node-loss recovery")
        assert last["source"] == "Peers" and last["cause"] == "hardware", (name, last)
        new = {p.metadata.name: p for p in jobs.pods(name)}[f"{name}-worker-1"]
        assert new.metadata.uid != lost[name].metadata.uid
        assert new.spec.node_name != lost[name].spec.node_name
        assert_resumed_at(state, ns, f"{name}-worker-1", int(last["restoredStep"]))
        print(f"{name}: node-loss recovery done {time.monotonic() - lost_at:.1f} s after the "
              f"loss, {last['breakdown']}")

    for name in pools:
        wait_for(lambda n=name: jobs.state(n) in ("Succeeded", "Failed"), 300,
                 f"{name} to finish")
        assert jobs.state(name) == "Succeeded", jobs.get(name)["status"]
        got, conflicts = losses(state, ns, f"{name}-worker-0")
        assert not conflicts and got == reference, name
        jobs.delete(name)
