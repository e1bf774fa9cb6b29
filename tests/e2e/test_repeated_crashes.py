"""Five trainer crashes within two minutes on one job, each recovered in process: the killed
rank's launcher outlives its training process and starts the next one itself, the survivor
keeps its process (its own log says "in-process restart", always with the same pid), no
container is restarted by the node, every recovery restores from local memory and goes on
from the restored step + 1, the downtime does not grow from crash to crash, and the losses
equal an uninterrupted run's."""

from __future__ import annotations

import re
import statistics
import time
from typing import Any

import pytest
from kubernetes import client

from gemini_demo.crash import kill_training_process
from tests.cluster.test_operator import Jobs, wait_for
from tests.cluster.test_operator_recovery import (
    ENV,
    _recovered_after,
    log_texts,
    losses,
    trainer_restarts,
)
from tests.fixtures.operator import OperatorThread
from tests.fixtures.trainers import EXAMPLE, SharedReferences
from tests.unit.operator.builders import make_job

# A count (five DeepSpeed crashes): `./dev long`; crash after crash of one job is proven in
# CI on kubelet nodes (test_kubelet_nodes.py's Helm case).
pytestmark = [pytest.mark.cluster, pytest.mark.e2e, pytest.mark.timeout(900), pytest.mark.long,
              pytest.mark.proves("repeated-crashes", "trainer-crash")]

CRASHES = 5
STEPS = 40
ARGS = ["--engine", "deepspeed", "--steps", str(STEPS), "--layers", "1", "--d-model", "32",
        "--step-sleep", "0.3"]
IN_PROCESS = re.compile(r"^gemini: in-process restart: epoch (\d+) \(pid (\d+)\)", re.M)


def newest_step(state: Any, namespace: str, pod: str) -> int:
    return max(losses(state, namespace, pod)[0], default=0)


def stepped_after_restore(state: Any, namespace: str, rank: int, restores: int) -> bool:
    """The rank's log shows its `restores`-th restore and a step after it."""
    text = "\n".join(log_texts(state, namespace, f"crashy-worker-{rank}"))
    found = list(re.finditer(r"^restored step \d+", text, re.M))
    return len(found) >= restores and re.search(
        r"^step \d+ loss", text[found[restores - 1].end():], re.M) is not None


def test_five_crashes_in_two_minutes_are_each_recovered_in_process_without_slowing_down(
    local_cluster: Any, gemini_operator: OperatorThread, kube_api: client.ApiClient,
    job_namespace: str, shared_references: SharedReferences,
) -> None:
    reference = shared_references(2, ARGS)
    state, ns = local_cluster.state_dir, job_namespace
    jobs = Jobs(kube_api, ns)
    jobs.create(make_job("crashy").with_nodes(2).with_replicas(2)
                .set("template.command", ["python", str(EXAMPLE), *ARGS])
                .set("template.env", ENV).set("failurePolicy.maxRestarts", 10).obj())
    wait_for(lambda: newest_step(state, ns, "crashy-worker-0") >= 3, 300, "step 3")

    try:
        downtimes, recoveries, within = crash_repeatedly(jobs, state, ns)
    except AssertionError as err:
        tails = "\n".join(f"--- {pod}\n" + "\n".join(
            line for line in "\n".join(log_texts(state, ns, pod)).splitlines()[-40:]
            if "Warning" not in line and "return func" not in line)
            for pod in ("crashy-worker-0", "crashy-worker-1"))
        raise AssertionError(f"{err}\n{tails}\nstatus: {jobs.get('crashy')['status']}") from err
    print(f"{CRASHES} crashes in {within:.0f} s; downtimes {[round(d, 1) for d in downtimes]}")
    assert within <= 120, f"the {CRASHES} crashes took {within:.0f} s"

    wait_for(lambda: jobs.state("crashy") in ("Succeeded", "Failed"), 300, "the job to finish")
    job = jobs.get("crashy")
    assert job["status"]["state"] == "Succeeded", job["status"]
    pods = {p.metadata.name: p for p in jobs.pods("crashy")}
    assert [trainer_restarts(pods[f"crashy-worker-{r}"]) for r in (0, 1)] == [0, 0], (
        "no container restart: the launchers outlived their training processes")

    survivor = "\n".join(log_texts(state, ns, "crashy-worker-0"))
    restarts = IN_PROCESS.findall(survivor)
    assert [int(e) for e, _ in restarts] == [int(r["epoch"]) for r in recoveries]
    assert len({pid for _, pid in restarts}) == 1, "the survivor kept one process throughout"
    for found, last in zip(IN_PROCESS.finditer(survivor), recoveries, strict=True):
        after = survivor[found.end():]
        resumed = re.search(r"^restored step (\d+) .*\n(?:.*\n)*?step (\d+) loss", after, re.M)
        assert resumed is not None
        assert (int(resumed.group(1)), int(resumed.group(2))) == (
            int(last["restoredStep"]), int(last["restoredStep"]) + 1)

    assert max(downtimes[1:]) <= 2 * statistics.median(downtimes) + 2, downtimes
    assert downtimes[-1] <= downtimes[0] + 3, f"the downtime grew: {downtimes}"
    got, conflicts = losses(state, ns, "crashy-worker-0")
    assert not conflicts and got == reference
    jobs.delete("crashy")


def crash_repeatedly(jobs: Jobs, state: Any, ns: str
                     ) -> tuple[list[float], list[dict[str, Any]], float]:
    """Kill rank 1's training process CRASHES times, each after the last recovery made two
    steps; the downtimes (kill to a step past the restored one on both ranks), the
    recoveries, and the seconds all took."""
    downtimes: list[float] = []
    recoveries: list[dict[str, Any]] = []
    started = time.monotonic()
    for crash in range(CRASHES):
        before = jobs.get("crashy")["status"]
        reached = newest_step(state, ns, "crashy-worker-0")
        kill_training_process(state, ns, "crashy-worker-1")
        killed = time.monotonic()
        last = wait_for(lambda b=before: _recovered_after(jobs, "crashy", b), 60,
                        f"recovery {crash + 1}")
        assert last["source"] == "Local" and last["cause"] == "software", last
        restored = int(last["restoredStep"])
        assert restored >= reached - 1, (restored, reached)
        # downtime: from the kill to the first step after this restore on both ranks
        for rank in (0, 1):
            wait_for(lambda r=rank, n=crash + 1: stepped_after_restore(state, ns, r, n), 60,
                     f"rank {rank} to make a step after its restore {crash + 1}")
        downtimes.append(time.monotonic() - killed)
        recoveries.append(last)
        wait_for(lambda s=restored: newest_step(state, ns, "crashy-worker-0") >= s + 2, 60,
                 "two more steps")

    return downtimes, recoveries, time.monotonic() - started
