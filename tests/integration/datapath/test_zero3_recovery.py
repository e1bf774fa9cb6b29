"""The proof, without Kubernetes: DeepSpeed ZeRO-3 on CPU/gloo at 4 ranks, m = 2, a checkpoint
every iteration, real `gemini sidecar` processes beside real trainer processes on loopback.

One story, three failures in a row, each continuing the training the previous recovery
resumed (DeepSpeed start-ups are the cost here, so the runs are chained), every printed loss
compared bit for bit (float hex) with one uninterrupted run:

1. every trainer is killed (software failure): restart from local memory; a version left
   half-written on one rank is never used;
2. rank 1's pod is lost (trainer, sidecar, shm): a fresh sidecar fetches rank 1's shard from
   its peer holder (the first path offered corrupts a chunk: detected, fetched again from the
   next holder) and re-pulls its replica; every rank restores the same version;
3. both holders of shards 0 and 1 are lost (ranks 0 and 1): every rank restores the step
   persisted to the real S3 server and committed while training ran.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gemini.slots.layout import SlotState
from gemini.slots.shard import ShardSlots
from tests.fixtures.s3 import sidecar_s3_env
from tests.fixtures.trainers import TrainingRun
from tests.integration.datapath.harness import (
    CorruptingProxy,
    Job,
    half_write,
    losses_match,
)

# five launches of four DeepSpeed ranks: well past the default per-test timeout on 2 cores
# `./dev long`: CI proves the same three restores of DeepSpeed ZeRO-3 on kubelet nodes
# (tests/e2e/test_kubelet_nodes.py, test_demo.py) and a corrupt chunk fetched again from the next
# holder in tests/integration/sidecar.
pytestmark = [pytest.mark.integration, pytest.mark.s3, pytest.mark.timeout(2400),
              pytest.mark.long]

WORLD = 4
STEPS = 12
MODEL = ["--engine", "deepspeed", "--layers", "2", "--d-model", "32", "--heads", "4",
         "--seq", "16", "--batch", "4", "--steps", str(STEPS)]
SLOW = ["--step-sleep", "0.3"]  # room to be killed mid-run; changes no computation
TIMEOUT = 600


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TrainingRun]:
    root = tmp_path_factory.mktemp("zero3-ref")
    run = TrainingRun(root / "logs", WORLD, MODEL, env={"GEMINI_SHM_DIR": str(root)}).start()
    try:
        run.wait_ok(TIMEOUT)
        assert all(sorted(run.losses(r)) == list(range(1, STEPS + 1)) for r in range(WORLD))
        yield run
    finally:
        run.kill()


@pytest.fixture()
def job(tmp_path: Path, s3_server, s3_prefix: str) -> Iterator[Job]:  # type: ignore[no-untyped-def]
    j = Job(tmp_path, WORLD, 2, sidecar_s3_env(s3_server, s3_prefix))
    try:
        yield j
    finally:
        j.close()


def restored_same_step(run: TrainingRun, world: int) -> int:
    steps = {run.restored_step(r) for r in range(world)}
    assert len(steps) == 1 and None not in steps, f"ranks restored {steps}:\n{run.tail()}"
    step = steps.pop()
    assert step is not None
    return step


def wait_printed(run: TrainingRun, step: int) -> None:
    """Wait until every rank printed ``step`` (the run keeps going)."""
    deadline = time.monotonic() + TIMEOUT
    while min(max(run.losses(r), default=0) for r in range(run.world)) < step:
        assert all(p.poll() is None for p in run.procs), f"a rank exited:\n{run.tail()}"
        assert time.monotonic() < deadline, f"step {step} not reached:\n{run.tail()}"
        time.sleep(0.05)


def test_zero3_four_ranks_recover_bit_exactly_from_memory_a_peer_and_s3(
    reference: TrainingRun, job: Job
) -> None:
    job.start_sidecars()
    assert job.placement.holders[1] == (1, 0) and job.placement.holders[0] == (0, 1)

    # -- 1. software failure: every trainer killed, the sidecars and shm survive ----------
    first = job.train("first", [*MODEL, *SLOW])
    reached = first.kill_at(3, TIMEOUT)
    for r in range(WORLD):
        losses_match(first, reference, r)
    lowest = min(range(WORLD), key=lambda r: max(job.local_versions(r)))
    torn = half_write(job.slot_file(lowest), reached + 1)
    assert torn.state is SlotState.WRITING
    assert reached + 1 not in job.local_versions(lowest)  # the inventory does not offer it

    second = job.train("second", [*MODEL, *SLOW], GEMINI_RESTORE_VERSION="latest",
                       GEMINI_RESTART_EPOCH="1")
    step1 = restored_same_step_when_up(second)
    assert 1 <= step1 <= reached
    wait_printed(second, step1 + 3)

    # -- 2. rank 1's pod is lost; a fresh sidecar fetches its shard from the peer holder ---
    second.procs[1].kill()
    job.lose_pod_memory(1)
    second.kill()
    for r in range(WORLD):
        losses_match(second, reference, r)
    candidates = job.replica_versions(0, 1)
    for r in (0, 2, 3):
        candidates &= job.local_versions(r)
    assert candidates, "no version is both replicated for rank 1 and local on the others"
    version = max(candidates)
    job.start_sidecar(1)
    proxy = CorruptingProxy(("127.0.0.1", job.peer_ports[0]))
    try:
        got = job.ok(1, "POST", "/fetch",
                     {"rank": 1, "version": version, "holders": [proxy.address, 0]})
    finally:
        proxy.close()
    assert proxy.flipped == 1, "the proxy corrupted nothing"
    assert got["version"] == version and job.peer_address(0) in got["holders_used"]
    assert "refetch it from another holder" in job.sidecars[1].log_text()
    with ShardSlots(job.slot_file(1)) as slots:
        assert slots.verify(version)
    refill = job.ok(1, "POST", "/fetch-replicas", {"version": version})
    assert [(r["rank"], r["version"]) for r in refill["replicas"]] == [(0, version)]

    third = job.train("third", [*MODEL, *SLOW], GEMINI_RESTORE_VERSION=str(version),
                      GEMINI_RESTORE_SOURCE="peer", GEMINI_RESTART_EPOCH="2")
    wait_printed(third, version + 1)
    assert restored_same_step(third, WORLD) == version
    committed = job.persist_and_commit()
    wait_printed(third, committed + 2)

    # -- 3. both holders of shards 0 and 1 lost: restore the committed step from S3 -------
    third.kill()
    for r in range(WORLD):
        losses_match(third, reference, r)
    job.lose_pod_memory(0)
    job.lose_pod_memory(1)
    job.start_sidecar(0)
    job.start_sidecar(1)
    for r in range(WORLD):
        assert job.ok(r, "POST", "/restore", {"version": committed})["version"] == committed

    last = job.train("last", MODEL, GEMINI_RESTORE_VERSION=str(committed),
                     GEMINI_RESTORE_SOURCE="s3", GEMINI_RESTART_EPOCH="3")
    last.wait_ok(TIMEOUT)
    assert restored_same_step(last, WORLD) == committed
    for r in range(WORLD):
        got_losses = losses_match(last, reference, r)
        assert sorted(got_losses) == list(range(committed + 1, STEPS + 1))


def restored_same_step_when_up(run: TrainingRun) -> int:
    deadline = time.monotonic() + TIMEOUT
    while any(run.restored_step(r) is None for r in range(run.world)):
        assert all(p.poll() is None for p in run.procs), f"a rank exited:\n{run.tail()}"
        assert time.monotonic() < deadline, f"no restore line:\n{run.tail()}"
        time.sleep(0.05)
    return restored_same_step(run, run.world)
