"""Kill every trainer mid-run, restart from shared memory: the losses continue bit-exactly.

Two ranks on loopback (gloo, CPU). The uninterrupted run gives the reference losses (float
hex); the interrupted run is SIGKILLed at some step, restarted with GEMINI_RESTORE_VERSION,
and must print exactly the reference losses for every step after the one it restored.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from gemini.slots.layout import SlotState, shard_path
from gemini.slots.shard import ShardSlots
from tests.fixtures.trainers import SharedReferences, TrainingRun

pytestmark = pytest.mark.integration

WORLD = 2
STEPS = 10
MODEL = ["--layers", "2", "--d-model", "32", "--heads", "4", "--seq", "16", "--batch", "4"]


def run(
    runs: list[TrainingRun],
    logs: Path,
    shm: Path,
    engine: str,
    steps: int,
    *extra_args: str,
    **env: str,
) -> TrainingRun:
    args = [*MODEL, "--engine", engine, "--steps", str(steps), *extra_args]
    r = TrainingRun(logs, WORLD, args, env={"GEMINI_SHM_DIR": str(shm), **env})
    runs.append(r)
    return r.start()


# CI: DDP (the engine no other test restores whole). DeepSpeed's and FSDP2's whole-job restores
# from memory are CI's in test_inprocess_training, datapath/test_fsdp2_recovery and the e2e
# layer; their twins here run in ./dev long.
@pytest.mark.parametrize("engine", [pytest.param("deepspeed", marks=pytest.mark.long), "ddp",
                                    pytest.param("fsdp2", marks=pytest.mark.long)])
def test_killing_all_trainers_and_restoring_latest_from_memory_continues_bit_exactly(
    engine: str, tmp_path: Path, training_runs: list[TrainingRun],
    shared_references: SharedReferences,
) -> None:
    expected = shared_references.every_rank(
        WORLD, [*MODEL, "--engine", engine, "--steps", str(STEPS)])
    assert all(sorted(e) == list(range(1, STEPS + 1)) for e in expected)

    shm = tmp_path / "shm"
    # a pause per step leaves room to be killed mid-run; it changes no computation
    crashed = run(training_runs, tmp_path / "crashed", shm, engine, STEPS, "--step-sleep", "0.2")
    reached = crashed.kill_at(4)
    assert reached < STEPS, "the run finished before it could be killed"
    for r in range(WORLD):  # what the crash left: a complete version, maybe one half-written
        with ShardSlots(shard_path(r, shm)) as slots:
            assert slots.latest_complete() is not None
            assert all(i.state is not SlotState.CORRUPT for i in slots.slot_info())

    resumed = run(
        training_runs,
        tmp_path / "resumed",
        shm,
        engine,
        STEPS,
        GEMINI_RESTORE_VERSION="latest",
        GEMINI_RESTART_EPOCH="1",
    )
    resumed.wait_ok()
    restored = {resumed.restored_step(r) for r in range(WORLD)}
    assert len(restored) == 1, f"ranks restored different steps: {restored}"
    step = restored.pop()
    assert step is not None and 1 <= step <= reached
    for r in range(WORLD):
        got = resumed.losses(r)
        assert sorted(got) == list(range(step + 1, STEPS + 1))
        assert got == {s: expected[r][s] for s in got}, f"rank {r} diverged after step {step}"


@pytest.mark.long  # CI: the kubelet recoveries restore the plan's version, often not the newest
def test_restoring_the_older_of_the_two_versions_is_bit_exact_too(
    tmp_path: Path, training_runs: list[TrainingRun], shared_references: SharedReferences,
) -> None:
    expected = shared_references.every_rank(WORLD, [*MODEL, "--engine", "ddp", "--steps", "8"])
    shm = tmp_path / "shm"
    run(training_runs, tmp_path / "first", shm, "ddp", 6).wait_ok()  # slots: steps 5 and 6
    resumed = run(training_runs, tmp_path / "resumed", shm, "ddp", 8, GEMINI_RESTORE_VERSION="5")
    resumed.wait_ok()
    for r in range(WORLD):
        assert resumed.restored_step(r) == 5
        assert resumed.losses(r) == {s: expected[r][s] for s in (6, 7, 8)}


def test_a_version_missing_from_memory_fails_restore_with_a_clear_message(
    tmp_path: Path, training_runs: list[TrainingRun]
) -> None:
    shm = tmp_path / "shm"
    run(training_runs, tmp_path / "first", shm, "ddp", 3).wait_ok()
    resumed = run(
        training_runs,
        tmp_path / "resumed",
        shm,
        "ddp",
        6,
        GEMINI_RESTORE_VERSION="1",
        GEMINI_RESTORE_TIMEOUT_S="1",
    )
    codes = resumed.wait()
    assert codes != [0, 0]
    assert "version 1 of rank 0 is not complete" in resumed.text(0)
