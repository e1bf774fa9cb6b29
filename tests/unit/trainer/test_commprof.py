"""The communication recorder times real gloo collectives per iteration and writes the profile."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from gemini_trainer.commprof import CommRecorder, read_phase


@pytest.fixture()
def gloo() -> Iterator[None]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_ops_inside_iterations_are_recorded_and_the_profile_written_after_n(
    gloo: None, tmp_path: Path
) -> None:
    out, phase = tmp_path / "profile.json", tmp_path / "phase"
    original = dist.all_reduce
    rec = CommRecorder(out, iterations=3, phase_file=phase).install()
    t = torch.ones(1000)
    dist.all_reduce(t)  # before any iteration: not recorded
    for _ in range(3):
        rec.iteration_start()
        assert read_phase(phase)[1] == 1  # type: ignore[index]
        dist.all_reduce(t)
        work = dist.all_reduce(t, async_op=True)
        work.wait()
        dist.broadcast(t, 0)
        rec.iteration_end()
    doc = json.loads(out.read_text())
    assert len(doc["iterations"]) == 3
    for it in doc["iterations"]:
        assert it["names"] == ["all_reduce", "all_reduce", "broadcast"]
        starts = [a for a, _ in it["ops"]]
        assert starts == sorted(starts)
        assert all(0 <= a <= b <= it["length"] for a, b in it["ops"])
    assert read_phase(phase) is not None and read_phase(phase)[:2] == (3, 0)  # type: ignore[index]
    assert dist.all_reduce is original, "recording stops after the profiled iterations"
    rec.close()


def test_uninstall_puts_the_original_functions_back(gloo: None) -> None:
    before = (dist.all_reduce, dist.distributed_c10d.all_gather_into_tensor)
    rec = CommRecorder(None).install()
    assert dist.all_reduce is not before[0]
    rec.uninstall()
    assert (dist.all_reduce, dist.distributed_c10d.all_gather_into_tensor) == before
