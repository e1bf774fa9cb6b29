"""A plain Hugging Face Accelerate loop with gemini_trainer's Checkpointer and
gemini_trainer.hf_accelerate.resumed_batches: kill every trainer mid-run, restart from shared
memory, and the loop resumes at the restored step with bit-identical losses.

Two ranks on loopback (gloo, CPU, DDP through Accelerate) run tests/integration/trainer/
accelerate_script.py: a tiny GPT-2 with dropout, data shuffled per epoch by Accelerate's seedable
sampler, 3 steps per epoch. Restarted once from a step inside an epoch (`latest`) and once from
the step that ends an epoch (a version number): the two ways the batches resume.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fixtures.trainers import TrainingRun

pytestmark = pytest.mark.integration

WORLD = 2
EPOCHS = 3
STEPS_PER_EPOCH = 3
STEPS = EPOCHS * STEPS_PER_EPOCH
SCRIPT = Path(__file__).with_name("accelerate_script.py")
LAUNCHER_ENV = {"LOCAL_WORLD_SIZE": str(WORLD)}  # both ranks on one node


def run(runs: list[TrainingRun], logs: Path, shm: Path, *extra_args: str, **env: str
        ) -> TrainingRun:
    r = TrainingRun(logs, WORLD, ["--epochs", str(EPOCHS), *extra_args], script=SCRIPT,
                    env={"GEMINI_SHM_DIR": str(shm), **LAUNCHER_ENV, **env})
    runs.append(r)
    return r.start()


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[dict[int, str]]]:
    root = tmp_path_factory.mktemp("accelerate-ref")
    runs: list[TrainingRun] = []
    try:
        ref = run(runs, root / "logs", root / "shm")
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
def test_killed_accelerate_loop_resumes_at_the_restored_step_bit_exactly(
    kill_at: int, restore: str, reference: list[dict[int, str]], tmp_path: Path,
    training_runs: list[TrainingRun],
) -> None:
    shm = tmp_path / "shm"
    crashed = run(training_runs, tmp_path / "crashed", shm, "--step-sleep", "0.3")
    reached = crashed.kill_at(kill_at)
    assert reached < STEPS, "the run finished before it could be killed"

    resumed = run(training_runs, tmp_path / "resumed", shm,
                  GEMINI_RESTORE_VERSION=restore, GEMINI_RESTART_EPOCH="1")
    resumed.wait_ok()
    step = resumed.agreed_restored_step("loop")
    if restore == "latest":
        assert kill_at - 1 <= step <= reached and step % STEPS_PER_EPOCH, step
    else:
        assert step == int(restore)
    resumed.assert_continues(step, STEPS, reference)


def test_an_unseeded_shuffling_loader_is_refused_with_the_setting_to_use(
    tmp_path: Path, training_runs: list[TrainingRun]
) -> None:
    refused = run(training_runs, tmp_path / "logs", tmp_path / "shm", "--unseeded-sampler")
    assert refused.wait() != [0] * WORLD
    assert "use_seedable_sampler=True" in refused.text(0), refused.tail()
