"""Fault matrix, part A: a GeminiJob training examples/train_gpt_zero3.py with DeepSpeed on the
local cluster survives each fault, and rank 0's per-step losses equal an uninterrupted run's.

Cases: a crashed sidecar (its replicas of peers come back), a hung rank (SIGSTOP, found by the
hang timeout, restarted in place from local memory), m-1 simultaneous node losses in one group
(the last holder serves both shards), a node lost while another node's recovery is under way
(one recovery covers both), a node cut off by a network partition and healed later (replaced
while cut off; once healed, its node agent ends the old pod's processes).
"""

from __future__ import annotations

import base64
import contextlib
import functools
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from gemini.control.client import ControlClient, ControlError
from gemini_local import faults
from gemini_operator.core import naming
from gemini_operator.core.render import RenderConfig
from tests.cluster.test_operator import Jobs, wait_for
from tests.cluster.test_operator_recovery import ENV, _recovered_after, losses, newest_step
from tests.fixtures.isolated_nodes import IsolatedNodes
from tests.fixtures.operator import OperatorThread
from tests.fixtures.trainers import EXAMPLE, SharedReferences
from tests.unit.operator.builders import make_job

# Node-agent twin of a kubelet-node proof: `./dev long` only (tests/proofs.py).
pytestmark = [pytest.mark.cluster, pytest.mark.e2e, pytest.mark.long]

STEPS = 12
MODEL = ["--engine", "deepspeed", "--steps", str(STEPS), "--layers", "1", "--d-model", "32"]
PORTS = RenderConfig()


def job_body(name: str, workers: int, replicas: int, step_sleep: float = 0.5,
             hang_timeout: int | None = None) -> dict[str, Any]:
    builder = (make_job(name).with_nodes(workers).with_replicas(replicas)
               .set("template.command", ["python", str(EXAMPLE), *MODEL, "--step-sleep",
                                         str(step_sleep)])
               .set("template.env", ENV)
               .set("failurePolicy.maxRestarts", 5))
    if hang_timeout is not None:
        builder = builder.set("failurePolicy.hangTimeoutSeconds", hang_timeout)
    return builder.obj()


@pytest.fixture(scope="module")
def reference(shared_references: SharedReferences) -> Any:
    """reference(world): rank 0's losses of an uninterrupted loopback run of that world size
    (losses do not depend on --step-sleep; each world size is run once per session, shared
    with the other modules training the same model)."""
    return lambda world: shared_references(world, MODEL)


class Job:
    """One GeminiJob of a case, with the reads the assertions need."""

    def __init__(self, jobs: Jobs, nodes: IsolatedNodes, body: dict[str, Any]) -> None:
        self.jobs, self.nodes, self.cluster = jobs, nodes, nodes.cluster
        self.name = str(body["metadata"]["name"])
        self.started = time.monotonic()
        jobs.create(body)

    @property
    def ns(self) -> str:
        return self.jobs.ns

    @property
    def state_dir(self) -> Path:
        return Path(self.cluster.state_dir)

    def status(self) -> dict[str, Any]:
        return dict((self.jobs.get(self.name) or {}).get("status") or {})

    def pods(self) -> dict[int, Any]:
        return {int(p.metadata.labels[naming.LABEL_RANK]): p for p in self.jobs.pods(self.name)
                if p.metadata.deletion_timestamp is None}

    def train_to(self, step: int) -> dict[str, Any]:
        """Wait until training started and rank 0 printed `step`; the status then."""
        wait_for(lambda: self.status().get("launch"), 180, "the operator to start training")
        wait_for(lambda: newest_step(self.state_dir, self.ns, f"{self.name}-worker-0") >= step,
                 300, f"training to reach step {step}")
        return self.status()

    def recovered_after(self, before: dict[str, Any], timeout: float = 240) -> dict[str, Any]:
        last: dict[str, Any] = wait_for(lambda: _recovered_after(self.jobs, self.name, before),
                                        timeout, "the recovery to finish")
        return last

    @functools.cached_property
    def token(self) -> str:
        secret: Any = self.jobs.core.read_namespaced_secret(naming.secret_name(self.name),
                                                            self.ns)
        return base64.b64decode(secret.data[naming.SECRET_TOKEN_KEY]).decode()

    def inventory(self, rank: int) -> dict[str, Any] | None:
        """Rank's sidecar inventory, None while it does not answer."""
        time.sleep(0.2)  # callers poll this: keep the load off the API server and sidecar
        ip = self.pods()[rank].status.pod_ip
        try:  # signed with the job token (issue 45: no token on the wire)
            return ControlClient(ip, PORTS.sidecar_api_port, self.token,
                                 timeout=2).call_json("/inventory")
        except ControlError:
            return None

    def finish_with(self, world: int, reference: Any) -> dict[str, Any]:
        """Wait for Succeeded; rank 0's losses equal the reference, none re-printed otherwise."""
        wait_for(lambda: self.status().get("state") in ("Succeeded", "Failed"), 300,
                 "the job to finish")
        print(f"case {self.name}: {time.monotonic() - self.started:.1f} s from creation to "
              f"the end of training")
        status = self.status()
        assert status["state"] == "Succeeded", status
        got, conflicts = losses(self.state_dir, self.ns, f"{self.name}-worker-0")
        assert not conflicts
        assert got == reference(world)
        return status

    def finished_recoveries(self) -> int:
        return sum(1 for e in self.jobs.events(self.name) if e.reason == "RecoveryFinished")

    def delete(self) -> None:
        self.jobs.delete(self.name)


@pytest.fixture
def new_job(isolated_nodes: IsolatedNodes, gemini_operator: OperatorThread,
            kube_api: client.ApiClient, job_namespace: str) -> Iterator[Any]:
    """A job on nodes of its own (one per worker; the shared nodes are cordoned meanwhile), so
    the nodes a case loses are its own and are removed afterwards."""
    made: list[Job] = []

    def make(body: dict[str, Any]) -> Job:
        for _ in range(int(body["spec"]["numNodes"])):
            isolated_nodes.add()
        job = Job(Jobs(kube_api, job_namespace), isolated_nodes, body)
        made.append(job)
        return job

    yield make
    for job in made:
        job.delete()


def _held_ranks(inventory: dict[str, Any] | None, newer_than: int) -> set[int]:
    """Ranks whose complete replica newer than `newer_than` the sidecar holds."""
    return {int(r["rank"]) for r in (inventory or {}).get("replicas") or ()
            if r.get("complete") and int(r["version"]) > newer_than}


@pytest.mark.proves("sidecar-crash")
def test_a_crashed_sidecar_restarts_and_holds_its_peers_replicas_again(
    new_job: Any, reference: Any,
) -> None:
    job = new_job(job_body("sidecar", 2, 2, step_sleep=1.5))
    job.nodes.add()  # for the peer loss at the end
    job.train_to(2)
    held = wait_for(lambda: _held_ranks(job.inventory(1), 0), 60, "rank 1 to hold replicas")
    assert held == {0}
    faults.kill_container(job.state_dir, job.ns, "sidecar-worker-1", naming.SIDECAR_CONTAINER)
    killed_at = newest_step(job.state_dir, job.ns, "sidecar-worker-0")
    # The restarted sidecar starts empty; coverage is back once it holds a newer replica.
    wait_for(lambda: _held_ranks(job.inventory(1), killed_at) == {0}, 60,
             "the restarted sidecar to hold rank 0's replica again")
    before = job.status()
    assert before.get("lastRecovery") is None and before["restarts"] == 0, before
    # The proof of coverage: rank 0's node fails, and its shard comes from rank 1's replica.
    old = job.pods()[0]
    faults.lose_node(job.state_dir, old.spec.node_name)
    last = job.recovered_after(before)
    print(f"peer loss after the sidecar crash: {last}")
    # Rank 1's trainer may fail first (rank 0 vanished mid-collective): it restarts in place.
    assert last["source"] == "Peers" and 0 in last["failedRanks"], last
    assert last["restoredStep"] > killed_at and last["stepsLost"] <= 1, last
    job.finish_with(2, reference)
    assert job.pods()[0].metadata.uid != old.metadata.uid


def _launcher_status(job: Job, rank: int) -> dict[str, Any]:
    ip = job.pods()[rank].status.pod_ip
    return ControlClient(ip, PORTS.launcher_port, job.token, timeout=10).call_json("/status")


@pytest.mark.proves("hang")
def test_a_hung_rank_is_found_by_the_hang_timeout_and_restarted_in_place(
    new_job: Any, reference: Any,
) -> None:
    job = new_job(job_body("hang", 2, 2, hang_timeout=20))
    before = job.train_to(4)
    uids = {r: p.metadata.uid for r, p in job.pods().items()}
    stopped = int(_launcher_status(job, 1)["pid"])  # the training process, not the launcher
    os.kill(stopped, signal.SIGSTOP)
    try:
        last = job.recovered_after(before, 180)
    finally:
        with contextlib.suppress(ProcessLookupError):  # a stopped survivor must not linger
            os.kill(stopped, signal.SIGKILL)
    print(f"hang recovery: {last}")
    assert last["cause"] == "hang" and last["source"] == "Local", last
    assert last["stepsLost"] <= 1, last
    job.finish_with(2, reference)
    assert {r: p.metadata.uid for r, p in job.pods().items()} == uids


@pytest.mark.proves("m-minus-one-at-once")
def test_losing_m_minus_one_nodes_of_a_group_at_once_recovers_from_the_last_holder(
    new_job: Any, reference: Any,
) -> None:
    job = new_job(job_body("group", 3, 3))
    job.nodes.add()  # the replacements' nodes
    job.nodes.add()
    before = job.train_to(4)
    pods = job.pods()
    lost = {pods[1].spec.node_name, pods[2].spec.node_name}
    for node in lost:
        faults.lose_node(job.state_dir, node)
    last = job.recovered_after(before)
    print(f"m-1 node losses: {last}")
    assert last["cause"] == "hardware" and last["source"] == "Peers", last
    # Rank 0's trainer may fail first (its peers vanished mid-collective): it restarts in place.
    assert {1, 2} <= set(last["failedRanks"]) and last["stepsLost"] <= 1, last
    now = job.pods()
    assert now[0].metadata.uid == pods[0].metadata.uid
    assert {now[r].spec.node_name for r in (1, 2)}.isdisjoint(lost)
    job.finish_with(3, reference)
    assert job.finished_recoveries() == 1


@pytest.mark.proves("loss-during-recovery")
def test_a_node_lost_during_another_recovery_joins_that_recovery(
    new_job: Any, reference: Any,
) -> None:
    job = new_job(job_body("twice", 3, 3))
    job.nodes.add()  # the replacements' nodes
    job.nodes.add()
    before = job.train_to(4)
    pods = job.pods()
    faults.lose_node(job.state_dir, pods[1].spec.node_name)
    phase = wait_for(lambda: (job.status().get("recovery") or {}).get("phase") in (
        "Replacing", "Fetching") and job.status()["recovery"], 120,
        "the first recovery to replace or fetch")
    # m = 3 on 3 workers: rank 0 still holds every shard, so the planner must stay in memory.
    faults.lose_node(job.state_dir, pods[2].spec.node_name)
    last = job.recovered_after(before)
    print(f"second loss during {phase['phase']}: {last}")
    assert last["cause"] == "hardware" and last["source"] == "Peers", last
    # Rank 0's trainer may fail first (its peers vanished mid-collective): it restarts in place.
    assert {1, 2} <= set(last["failedRanks"]) and last["stepsLost"] <= 1, last
    job.finish_with(3, reference)
    assert job.finished_recoveries() == 1


def _pod_processes_alive(state_dir: Path, namespace: str, pod: str, uid: str) -> list[int]:
    alive = []
    for pid_file in state_dir.glob(f"nodes/*/pods/{namespace}_{pod}_{uid}/containers/*.pid"):
        try:
            pid = int(pid_file.read_text().split()[0])
            os.kill(pid, 0)
            alive.append(pid)
        except (OSError, ValueError, IndexError):
            continue
    return alive


@pytest.mark.proves("partition-heal")
def test_a_partitioned_node_is_replaced_and_its_old_pod_stays_gone_after_the_heal(
    new_job: Any, reference: Any,
) -> None:
    job = new_job(job_body("split", 2, 2, step_sleep=1.5))
    job.nodes.add()  # the replacement's node
    before = job.train_to(4)
    old = job.pods()[1]
    node = str(old.spec.node_name)
    faults.partition_node(job.state_dir, node)
    try:
        # The cut is real: rank 0 cannot finish a step without rank 1 (gloo's traffic is cut).
        cut_at = newest_step(job.state_dir, job.ns, "split-worker-0")
        time.sleep(6)
        assert newest_step(job.state_dir, job.ns, "split-worker-0") <= cut_at + 1
        last = job.recovered_after(before)
    finally:
        faults.heal_node(job.state_dir, node)
    print(f"partition recovery: {last}")
    assert last["cause"] == "hardware" and last["source"] == "Peers", last
    assert last["stepsLost"] <= 1, last
    assert job.pods()[1].metadata.uid != old.metadata.uid
    core = job.cluster.core
    wait_for(lambda: any(c.type == "Ready" and c.status == "True"
                         for c in core.read_node(node).status.conditions or ()), 60,
             f"node {node} Ready again after the heal")
    wait_for(lambda: not _pod_processes_alive(job.state_dir, job.ns, "split-worker-1",
                                              old.metadata.uid), 60,
             "the healed node to stop the old pod's containers")
    status = job.finish_with(2, reference)
    assert job.pods()[1].metadata.uid != old.metadata.uid
    assert status["lastRecovery"]["epoch"] == last["epoch"]  # nothing disturbed the job again
