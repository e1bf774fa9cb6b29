"""The control plane itself failing mid-recovery (issue 45), on node agents, in `./dev long`:

- two operator replicas (processes, one Lease): the leader SIGKILLed while it recovers a lost
  node; the standby takes the Lease when it expires and finishes the recovery from
  status.recovery;
- the API server frozen (SIGSTOP) for 20 s while the operator recovers a lost node; the
  recovery completes after it returns.

Each ends with the trainers' own logs showing the restored step's successor run next, and rank
0's losses equal to an uninterrupted run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from gemini_local import faults, processes
from gemini_local.controlplane import ControlPlane
from gemini_local.processes import free_port
from tests.cluster.test_operator import wait_for
from tests.cluster.test_operator_recovery import log_texts
from tests.e2e.kubelet_training import resumed_at
from tests.e2e.test_fault_matrix_a import Job, job_body, new_job, reference  # noqa: F401
from tests.fixtures.operator import OperatorThread

pytestmark = [pytest.mark.cluster, pytest.mark.e2e, pytest.mark.long]
REPO = Path(__file__).resolve().parents[2]
LEASE = "gemini-operator"  # in the job's namespace: apart from the session operator's


class OperatorProcess:
    """`gemini operator run` as a process of its own, watching one namespace."""

    def __init__(self, plane: ControlPlane, namespace: str, identity: str, logs: Path) -> None:
        hints = free_port()
        self.identity, self.log = identity, logs / f"operator-{identity}.log"
        command = [sys.executable, "-m", "gemini_cli", "operator", "run",
                   "--kubeconfig", str(plane.kubeconfig), "--namespace", namespace,
                   "--lease-namespace", namespace, "--identity", identity,
                   "--sidecar-image", "gemini:test", "--hint-port", str(hints),
                   "--hint-url", f"http://127.0.0.1:{hints}"]
        with open(self.log, "wb") as out:
            self.process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT,
                                            cwd=REPO, start_new_session=True)

    def kill(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(10)


@pytest.fixture
def replicas(gemini_operator: OperatorThread, control_plane: ControlPlane, job_namespace: str,
             tmp_path: Path) -> Iterator[Any]:
    """Operator processes for the job's namespace; the session's operator (every namespace)
    stopped meanwhile, so that only they act there, and started again afterwards."""
    gemini_operator.stop()
    started: list[OperatorProcess] = []

    def start(identity: str) -> OperatorProcess:
        started.append(OperatorProcess(control_plane, job_namespace, identity, tmp_path))
        return started[-1]

    try:
        yield start
    finally:
        for replica in started:
            replica.kill()
        gemini_operator.restart()


def lease_holder(kube_api: client.ApiClient, namespace: str) -> str | None:
    try:
        lease: Any = client.CoordinationV1Api(kube_api).read_namespaced_lease(LEASE, namespace)
    except ApiException as err:
        if err.status == 404:  # not taken yet
            return None
        raise
    return lease.spec.holder_identity


def recovery_in(job: Job, phases: tuple[str, ...]) -> dict[str, Any] | None:
    recovery: dict[str, Any] = job.status().get("recovery") or {}
    return recovery if recovery.get("phase") in phases else None


def lose_rank_zero_mid_recovery(job: Job) -> tuple[dict[str, Any], dict[str, Any]]:
    """Train to step 3 with a spare node ready, power off rank 0's node; (the status before,
    status.recovery once it replaces or fetches)."""
    job.nodes.add()  # the replacement's node
    before = job.train_to(3)
    faults.lose_node(job.state_dir, job.pods()[0].spec.node_name)
    during = wait_for(lambda: recovery_in(job, ("Replacing", "Fetching")), 120,
                      "the recovery to replace or fetch")
    return before, during


def resumed_from_the_restored_step(job: Job, restored: int) -> None:
    for rank in (0, 1):
        pod = f"{job.name}-worker-{rank}"
        wait_for(lambda p=pod: resumed_at("".join(log_texts(job.state_dir, job.ns, p)),
                                          restored), 120,
                 f"{pod} to step on from the restored step {restored}")


def test_the_standby_replica_finishes_a_recovery_when_the_leader_is_killed(
        new_job: Any, reference: Any, replicas: Any, kube_api: client.ApiClient,  # noqa: F811
        job_namespace: str) -> None:
    first = replicas("replica-a")
    wait_for(lambda: lease_holder(kube_api, job_namespace) == "replica-a", 60,
             "replica-a to lead")
    replicas("replica-b")
    job = new_job(job_body("failover", 2, 2, step_sleep=1.0))
    before, during = lose_rank_zero_mid_recovery(job)
    first.kill()
    killed = time.monotonic()
    last = job.recovered_after(before, timeout=240)
    took = time.monotonic() - killed
    assert lease_holder(kube_api, job_namespace) == "replica-b"
    assert last["source"] == "Peers" and 0 in last["failedRanks"], last
    assert last["stepsLost"] <= 1, last
    resumed_from_the_restored_step(job, last["restoredStep"])
    print(f"leader killed during {during['phase']}; the standby finished the recovery "
          f"{took:.1f} s after the kill: {last}")
    job.finish_with(2, reference)


def test_a_recovery_completes_after_the_api_server_was_gone_for_20_s(
        new_job: Any, reference: Any, control_plane: ControlPlane) -> None:  # noqa: F811
    job = new_job(job_body("apigone", 2, 2, step_sleep=1.0))
    before, during = lose_rank_zero_mid_recovery(job)
    pid = processes.running_pid("kube-apiserver", control_plane.pid_dir)
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(20)
    finally:
        os.kill(pid, signal.SIGCONT)
    back = time.monotonic()
    last = job.recovered_after(before, timeout=300)
    assert last["source"] == "Peers" and 0 in last["failedRanks"], last
    resumed_from_the_restored_step(job, last["restoredStep"])
    print(f"API server frozen 20 s during {during['phase']}; recovery finished "
          f"{time.monotonic() - back:.1f} s after it came back: {last}")
    job.finish_with(2, reference)
