"""Checkpointer in one process: snapshot, restore, the tree codec and the failure paths."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch

from gemini.slots.layout import SlotError, shard_path
from gemini.slots.shard import ShardSlots
from gemini_trainer.capture import decode_tree, encode_tree
from gemini_trainer.checkpointer import Checkpointer
from gemini_trainer.checkpointer_config import (
    CheckpointerConfig,
    RestoreError,
    RestoreInstruction,
)


def make(
    seed: int = 0, device: str = "cpu"
) -> tuple[torch.nn.Module, torch.optim.Optimizer, object]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.Dropout(0.2), torch.nn.Linear(16, 2)
    )
    model = model.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return model, opt, sched


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, sched: object, step: int) -> str:
    device = next(model.parameters()).device
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step)).to(device)
    noise = torch.rand(1).item() + random.random() + float(np.random.rand())  # all three RNGs
    loss = model(x).pow(2).mean() * (1 + noise)
    loss.backward()
    opt.step()
    opt.zero_grad()
    sched.step()  # type: ignore[attr-defined]
    return float(loss.item()).hex()


def config(tmp_path: Path, **kw: object) -> CheckpointerConfig:
    return CheckpointerConfig(rank=0, world_size=1, shm_dir=tmp_path, **kw)  # type: ignore[arg-type]


DEVICES = [
    "cpu",
    pytest.param("cuda", marks=[
        pytest.mark.cuda,
        pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]),
]


@pytest.mark.parametrize("device", DEVICES)
def test_restore_then_continue_gives_the_same_losses_as_never_stopping(
    tmp_path: Path, device: str
) -> None:
    model, opt, sched = make(device=device)
    ckpt = Checkpointer(model, opt, sched, config=config(tmp_path))
    losses, lrs = [], []
    for step in range(8):
        losses.append(train_step(model, opt, sched, step))
        lrs.append(opt.param_groups[0]["lr"])
        if step < 5:  # the slots end up holding steps 4 and 5
            ckpt.snapshot(step + 1, extra={"cursor": step + 1, "name": "run"})
    ckpt.close()

    # a new process would start from other weights and other RNG states
    model2, opt2, sched2 = make(seed=99, device=device)
    random.seed(5)
    np.random.seed(5)
    ckpt2 = Checkpointer(model2, opt2, sched2, config=config(tmp_path))
    start = ckpt2.restore(RestoreInstruction(version=4))
    assert start == 4 and ckpt2.extra_state == {"cursor": 4, "name": "run"}
    with ShardSlots(ckpt2.path) as slots:  # step 5 was of the run that stopped: gone
        assert [(i.version, i.complete) for i in slots.slot_info() if i.complete] == [(4, True)]
    assert opt2.param_groups[0]["lr"] == lrs[3] != 0.01  # the schedule is restored too
    again = [train_step(model2, opt2, sched2, step) for step in range(4, 8)]
    assert again == losses[4:8]
    ckpt2.close()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_a_cuda_shard_fetched_into_another_slot_file_restores_bit_exactly(
    tmp_path: Path,
) -> None:
    """As after a peer fetch: the committed payload written into a new node's slot file (the
    sidecar's put) restores a CUDA model and optimizer, and training continues identically."""
    model, opt, sched = make(device="cuda")
    ckpt = Checkpointer(model, opt, sched, config=config(tmp_path / "a"))
    losses = []
    for step in range(6):
        losses.append(train_step(model, opt, sched, step))
        ckpt.snapshot(step + 1)  # CUDA copies overlap the next steps; version 3 kept below
        if step == 2:
            ckpt.flush()
            with ShardSlots(ckpt.path) as slots:
                info = slots.find(3)
                assert info is not None
                payload = bytes(slots.read(3, verify=True))
    ckpt.close()
    (tmp_path / "b").mkdir()
    with ShardSlots(shard_path(0, tmp_path / "b"), len(payload) + (1 << 20)) as fetched:
        fetched.put(3, [payload], checksum=info.checksum)
    model2, opt2, sched2 = make(seed=99, device="cuda")
    ckpt2 = Checkpointer(model2, opt2, sched2, config=config(tmp_path / "b"))
    assert ckpt2.restore(RestoreInstruction(version=3, source="peer")) == 3
    assert [train_step(model2, opt2, sched2, step) for step in range(3, 6)] == losses[3:6]
    ckpt2.close()


def test_without_a_restore_version_training_starts_fresh(tmp_path: Path) -> None:
    model, opt, sched = make()
    ckpt = Checkpointer(model, opt, sched, config=config(tmp_path))
    assert ckpt.restore(RestoreInstruction.from_env({})) is None
    ckpt.close()


def test_a_version_that_never_completes_is_refused_after_the_timeout(tmp_path: Path) -> None:
    model, opt, sched = make()
    ckpt = Checkpointer(model, opt, sched, config=config(tmp_path))
    ckpt.snapshot(1)
    ckpt.flush()
    with pytest.raises(RestoreError, match="version 3 of rank 0 is not complete"):
        ckpt.restore(RestoreInstruction(version=3, timeout_s=0.2))
    ckpt.close()


def test_a_shard_written_by_another_rank_is_refused(tmp_path: Path) -> None:
    model, opt, sched = make()
    ckpt = Checkpointer(model, opt, sched, config=config(tmp_path))
    ckpt.snapshot(1)
    ckpt.close()
    shard_path(0, tmp_path).rename(shard_path(1, tmp_path))
    other = Checkpointer(
        model, opt, sched, config=CheckpointerConfig(rank=1, world_size=2, shm_dir=tmp_path)
    )
    with pytest.raises(RestoreError, match="wrong shard"):
        other.restore(RestoreInstruction(version=1))
    other.close()


def test_a_missing_sidecar_is_recorded_and_training_goes_on(tmp_path: Path) -> None:
    model, opt, sched = make()
    cfg = config(tmp_path, sidecar_url="http://127.0.0.1:9", heartbeat_file=tmp_path / "hb")
    ckpt = Checkpointer(model, opt, sched, config=cfg)
    ckpt.snapshot(1)
    ckpt.snapshot(2)
    ckpt.flush()
    assert len(ckpt.errors) == 2 and "notifying the sidecar" in ckpt.errors[0]
    assert (tmp_path / "hb").read_text().split()[0] == "2"
    with ShardSlots(shard_path(0, tmp_path)) as slots:
        assert slots.latest_complete().version == 2  # type: ignore[union-attr]
    ckpt.close()


def test_a_state_larger_than_the_slot_is_refused_with_the_fix(tmp_path: Path) -> None:
    model, opt, sched = make()
    ckpt = Checkpointer(model, opt, sched, config=config(tmp_path, capacity_bytes=1024))
    with pytest.raises(SlotError, match="GEMINI_SHM_CAPACITY_BYTES"):
        ckpt.snapshot(1)
    ckpt.close()


def test_restore_instruction_from_the_launcher_environment() -> None:
    env = {
        "GEMINI_RESTORE_VERSION": "12",
        "GEMINI_RESTORE_SOURCE": "peer",
        "GEMINI_RESTART_EPOCH": "3",
    }
    assert RestoreInstruction.from_env(env) == RestoreInstruction(12, False, "peer", 3)
    assert RestoreInstruction.from_env({"GEMINI_RESTORE_VERSION": "latest"}).latest
    assert RestoreInstruction.from_env({"GEMINI_RESTORE_VERSION": "none"}).version is None
    with pytest.raises(RestoreError, match="step number"):
        RestoreInstruction.from_env({"GEMINI_RESTORE_VERSION": "yesterday"})


def test_the_tree_codec_keeps_types_keys_and_exact_floats() -> None:
    tree = {
        "f": 0.1 + 0.2,
        "inf": float("inf"),
        "t": (1, "a", None, True),
        3: "int key",
        "__x": 1,
        "b": b"\x00\xff",
        "dt": torch.bfloat16,
        "nd": np.arange(3),
        "ten": torch.arange(4.0),
        "nested": [{"k": torch.zeros(2, dtype=torch.bfloat16)}],
    }
    skeleton, tensors = encode_tree(tree)
    back = decode_tree(skeleton, tensors)
    assert back["f"] == tree["f"] and back["inf"] == float("inf") and back["t"] == tree["t"]
    assert back[3] == "int key" and back["__x"] == 1 and back["b"] == b"\x00\xff"
    assert back["dt"] is torch.bfloat16 and np.array_equal(back["nd"], np.arange(3))
    assert torch.equal(back["ten"], torch.arange(4.0))
    assert back["nested"][0]["k"].dtype == torch.bfloat16


def test_state_the_codec_cannot_store_is_named_in_the_error() -> None:
    with pytest.raises(TypeError, match=r"state\.extra\.when of type object"):
        encode_tree({"extra": {"when": object()}})


def test_the_payload_keeps_its_size_from_step_to_step(tmp_path: Path) -> None:
    # A slot file made to the size of one version (the sidecar makes it so for a fetched
    # copy) must fit the versions the restored trainer writes next.
    model, opt, sched = make()
    ckpt = Checkpointer(model, opt, sched, config=config(tmp_path))
    sizes = set()
    for step in (9, 10, 99, 100, 1000, 123456789):
        train_step(model, opt, sched, step)
        sizes.add(ckpt.snapshot(step, extra={"position": step}).nbytes)
    ckpt.close()
    assert len(sizes) == 1


def test_latest_restores_the_newest_complete_version_or_starts_fresh(tmp_path: Path) -> None:
    model, opt, sched = make()
    fresh = Checkpointer(model, opt, sched, config=config(tmp_path / "empty"))
    assert fresh.restore(RestoreInstruction(None, latest=True)) is None
    fresh.close()
    ckpt = Checkpointer(model, opt, sched, config=config(tmp_path))
    for step in (1, 2, 3):
        ckpt.snapshot(step)
    ckpt.close()
    again = Checkpointer(model, opt, sched, config=config(tmp_path))
    assert again.restore(RestoreInstruction(None, latest=True)) == 3
    again.close()
