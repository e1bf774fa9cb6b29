"""PyTorch FSDP2 at 2 ranks, m = 2, real sidecars: the same data path as ZeRO-3.

Chained like the ZeRO-3 story (one uninterrupted reference run, every loss compared in float
hex): every trainer killed -> restore the latest version from local memory; then rank 0's pod
lost -> its fresh sidecar fetches rank 0's shard from rank 1 and re-pulls its replica, both
ranks restore that version and finish the run.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gemini.slots.shard import ShardSlots
from tests.fixtures.trainers import TrainingRun
from tests.integration.datapath.harness import Job, losses_match

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1200)]

WORLD = 2
STEPS = 12
MODEL = ["--engine", "fsdp2", "--layers", "2", "--d-model", "32", "--heads", "4",
         "--seq", "16", "--batch", "4", "--steps", str(STEPS)]
SLOW = ["--step-sleep", "0.2"]
TIMEOUT = 300


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TrainingRun]:
    root = tmp_path_factory.mktemp("fsdp2-ref")
    run = TrainingRun(root / "logs", WORLD, MODEL, env={"GEMINI_SHM_DIR": str(root)}).start()
    try:
        run.wait_ok(TIMEOUT)
        yield run
    finally:
        run.kill()


@pytest.fixture()
def job(tmp_path: Path) -> Iterator[Job]:
    j = Job(tmp_path, WORLD, 2)
    try:
        yield j
    finally:
        j.close()


def wait_printed(run: TrainingRun, step: int) -> None:
    deadline = time.monotonic() + TIMEOUT
    while min(max(run.losses(r), default=0) for r in range(run.world)) < step:
        assert all(p.poll() is None for p in run.procs), f"a rank exited:\n{run.tail()}"
        assert time.monotonic() < deadline, f"step {step} not reached:\n{run.tail()}"
        time.sleep(0.05)


# ./dev long: CI restores FSDP2 in the shipped example's image on kubelet nodes
# (test_kubelet_nodes.py), and restores from a peer with DeepSpeed; the sidecar's peer path does
# not depend on the engine.
@pytest.mark.long
def test_fsdp2_two_ranks_recover_bit_exactly_from_memory_and_from_the_peer(
    reference: TrainingRun, job: Job
) -> None:
    job.start_sidecars()
    first = job.train("first", [*MODEL, *SLOW])
    reached = first.kill_at(3, TIMEOUT)
    for r in range(WORLD):
        losses_match(first, reference, r)

    second = job.train("second", [*MODEL, *SLOW], GEMINI_RESTORE_VERSION="latest",
                       GEMINI_RESTART_EPOCH="1")
    wait_printed(second, reached + 2)
    restored = {second.restored_step(r) for r in range(WORLD)}
    assert len(restored) == 1 and 1 <= (restored.pop() or 0) <= reached

    second.procs[0].kill()
    job.lose_pod_memory(0)
    second.kill()
    for r in range(WORLD):
        losses_match(second, reference, r)
    candidates = job.replica_versions(1, 0) & job.local_versions(1)
    assert candidates, "no version is both replicated for rank 0 and local on rank 1"
    version = max(candidates)
    job.start_sidecar(0)
    got = job.ok(0, "POST", "/fetch", {"rank": 0, "version": version, "holders": [1]})
    assert got["version"] == version
    with ShardSlots(job.slot_file(0)) as slots:
        assert slots.verify(version)
    assert job.ok(0, "POST", "/fetch-replicas", {})["replicas"][0]["rank"] == 1

    last = job.train("last", MODEL, GEMINI_RESTORE_VERSION=str(version),
                     GEMINI_RESTORE_SOURCE="peer", GEMINI_RESTART_EPOCH="2")
    last.wait_ok(TIMEOUT)
    for r in range(WORLD):
        assert last.restored_step(r) == version
        assert sorted(losses_match(last, reference, r)) == list(range(version + 1, STEPS + 1))
