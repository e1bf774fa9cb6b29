"""The Hugging Face Trainer with gemini_trainer.hf.GeminiCallback: kill every trainer mid-run,
restart from shared memory, and the Trainer resumes at the restored step (its global step,
epoch, data order and RNG states) with bit-identical losses.

Two ranks on loopback (gloo, CPU, DDP through Accelerate) run tests/integration/trainer/
hf_trainer_script.py: a tiny GPT-2 with dropout, data shuffled per epoch, 3 optimizer steps per
epoch of 2 accumulated batches. The killed run is restarted once from a step inside an epoch
(`latest`) and once from the step that ends an epoch (a version number, as after a restore from
a peer or S3): the two ways the Trainer's data loop resumes.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fixtures.trainers import TrainingRun

pytestmark = pytest.mark.integration

WORLD = 2
STEPS = 8
STEPS_PER_EPOCH = 3
SCRIPT = Path(__file__).with_name("hf_trainer_script.py")
LAUNCHER_ENV = {"LOCAL_WORLD_SIZE": str(WORLD)}  # both ranks on one node


def run(runs: list[TrainingRun], root: Path, name: str, shm: Path, *extra_args: str,
        **env: str) -> TrainingRun:
    args = ["--steps", str(STEPS), "--output-dir", str(root / name / "out"), *extra_args]
    r = TrainingRun(root / name, WORLD, args, script=SCRIPT,
                    env={"GEMINI_SHM_DIR": str(shm), **LAUNCHER_ENV, **env})
    runs.append(r)
    return r.start()


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[dict[int, str]]]:
    root = tmp_path_factory.mktemp("hf-ref")
    runs: list[TrainingRun] = []
    try:
        ref = run(runs, root, "ref", root / "shm")
        ref.wait_ok()
        losses = [ref.losses(r) for r in range(WORLD)]
        assert all(sorted(got) == list(range(1, STEPS + 1)) for got in losses), ref.tail()
        yield losses
    finally:
        for r in runs:
            r.kill()


@pytest.mark.parametrize(
    "kill_at, restore",
    [(5, "latest"),
     # a second restore point, same path: `./dev long`
     pytest.param(STEPS_PER_EPOCH * 2 + 1, str(STEPS_PER_EPOCH * 2), marks=pytest.mark.long)],
    ids=["mid-epoch-latest", "epoch-end-version"],
)
def test_killed_hf_trainers_resume_at_the_restored_step_bit_exactly(
    kill_at: int, restore: str, reference: list[dict[int, str]], tmp_path: Path,
    training_runs: list[TrainingRun],
) -> None:
    shm = tmp_path / "shm"
    crashed = run(training_runs, tmp_path, "crashed", shm, "--step-sleep", "0.3")
    reached = crashed.kill_at(kill_at)
    assert reached < STEPS, "the run finished before it could be killed"

    resumed = run(training_runs, tmp_path, "resumed", shm,
                  GEMINI_RESTORE_VERSION=restore, GEMINI_RESTART_EPOCH="1")
    resumed.wait_ok()
    step = resumed.agreed_restored_step("Trainer")
    if restore == "latest":
        assert kill_at - 1 <= step <= reached and step % STEPS_PER_EPOCH, step
    else:
        assert step == int(restore)
    resumed.assert_continues(step, STEPS, reference)
