"""DeepSpeed ZeRO-1, ZeRO-2 and ZeRO-3 with the optimizer offloaded to CPU: kill every trainer
mid-run, restart from shared memory, and the losses continue bit-exactly.

Two ranks on loopback (gloo, CPU), started as a launcher that runs several ranks per node
starts them (RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE all set). The uninterrupted run
gives the reference losses (float hex); the interrupted run is SIGKILLed at some step and
restarted with GEMINI_RESTORE_VERSION=latest. The restarted trainer must say which step it
restored, print no step up to it (it resumed, it did not train again from step 0) and print
exactly the reference losses for every step after it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from gemini.slots.shard import ShardSlots
from tests.fixtures.trainers import SharedReferences, TrainingRun

pytestmark = pytest.mark.integration

WORLD = 2
STEPS = 10
MODEL = ["--layers", "2", "--d-model", "32", "--heads", "4", "--seq", "16", "--batch", "4"]
LAUNCHER_ENV = {"LOCAL_WORLD_SIZE": str(WORLD)}  # both ranks on one node


def run(runs: list[TrainingRun], logs: Path, shm: Path, stage: list[str], steps: int,
        *extra_args: str, **env: str) -> TrainingRun:
    args = [*MODEL, "--engine", "deepspeed", *stage, "--steps", str(steps), *extra_args]
    r = TrainingRun(logs, WORLD, args, env={"GEMINI_SHM_DIR": str(shm), **LAUNCHER_ENV, **env})
    runs.append(r)
    return r.start()


@pytest.mark.parametrize(
    "stage",
    # ZeRO-1 and -2 are ZeRO-3's twins here (the same save and restore path, less sharded):
    # ./dev long runs them, CI the ZeRO-3 one with its optimizer offloaded.
    [pytest.param(["--zero-stage", "1"], marks=pytest.mark.long, id="zero1"),
     pytest.param(["--zero-stage", "2"], marks=pytest.mark.long, id="zero2"),
     pytest.param(["--zero-stage", "3", "--offload-optimizer"], id="zero3-offload")],
)
def test_killed_zero_trainers_resume_at_the_restored_step_bit_exactly(
    stage: list[str], tmp_path: Path, training_runs: list[TrainingRun],
    shared_references: SharedReferences,
) -> None:
    expected = shared_references.every_rank(
        WORLD, [*MODEL, "--engine", "deepspeed", *stage, "--steps", str(STEPS)], env=LAUNCHER_ENV)
    assert all(sorted(e) == list(range(1, STEPS + 1)) for e in expected)

    shm = tmp_path / "shm"
    # a pause per step leaves room to be killed mid-run; it changes no computation
    crashed = run(training_runs, tmp_path / "crashed", shm, stage, STEPS, "--step-sleep", "0.2")
    reached = crashed.kill_at(4)
    assert reached < STEPS, "the run finished before it could be killed"
    slot_files = sorted(shm.glob("*.slots"))  # one per rank, or per node with ranks per node
    assert slot_files, "the killed run left no checkpoint in shared memory"
    for path in slot_files:
        with ShardSlots(path) as slots:
            assert slots.latest_complete() is not None, f"{path} holds no complete version"

    resumed = run(training_runs, tmp_path / "resumed", shm, stage, STEPS,
                  GEMINI_RESTORE_VERSION="latest", GEMINI_RESTART_EPOCH="1")
    resumed.wait_ok()
    step = resumed.agreed_restored_step()
    assert 1 <= step <= reached, f"restored {step}, killed at {reached}"
    resumed.assert_continues(step, STEPS, expected)
