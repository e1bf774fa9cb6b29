"""Ranks decide together whether to snapshot: while one rank's newest version is not on every
holder (not acknowledged), every rank keeps its older slot, so the newest version all holders
have is never overwritten. Real processes, a real gloo process group."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

# Each rank snapshots steps 1..10. A stand-in sidecar in the rank itself acknowledges its
# newest version after each step: rank 0 at once, rank 1 only from step LAG_UNTIL on.
WORKER = r"""
import json, sys
from pathlib import Path
import torch
import torch.distributed as dist
from gemini_trainer.checkpointer import Checkpointer
from gemini_trainer.checkpointer_config import CheckpointerConfig
from gemini.slots.shard import ShardSlots

rank, world, store, shm, out, lag_until = sys.argv[1:7]
rank, world, lag_until = int(rank), int(world), int(lag_until)
dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
torch.manual_seed(rank)
model = torch.nn.Linear(8, 8)
config = CheckpointerConfig(rank=rank, world_size=world, shm_dir=Path(shm), job="agree",
                            sidecar_url="http://127.0.0.1:9", profile_iterations=0)
ckpt = Checkpointer(model, torch.optim.SGD(model.parameters(), lr=0.1), config=config)
skipped = []
for step in range(1, 11):
    skipped.append(ckpt.snapshot(step).skipped)
    ckpt.flush()
    if rank == 0 or step >= lag_until:
        with ShardSlots(ckpt.path) as slots:
            slots.acknowledge(slots.latest_complete().seq)
with ShardSlots(ckpt.path) as slots:
    held = sorted(i.version for i in slots.slot_info() if i.complete)
Path(out).write_text(json.dumps({"skipped": skipped, "held": held}))
ckpt.close()
dist.destroy_process_group()
"""


def run_ranks(tmp_path: Path, lag_until: int) -> list[dict[str, list]]:
    outs = [tmp_path / f"rank{r}.json" for r in range(2)]
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(r), "2",
                               str(tmp_path / "store"), str(tmp_path / "shm"), str(outs[r]),
                               str(lag_until)]) for r in range(2)]
    for proc in procs:
        assert proc.wait(timeout=120) == 0
    return [json.loads(out.read_text()) for out in outs]


def test_every_rank_skips_while_one_ranks_newest_version_is_not_acknowledged(tmp_path):
    ranks = run_ranks(tmp_path, lag_until=6)
    # Steps 1 and 2 fill the two slots; rank 1's version 2 is acknowledged after step 6, so
    # steps 3-6 are skipped by both ranks (rank 0 alone would have written them all).
    expected = [False, False, True, True, True, True, False, False, False, False]
    assert ranks[0]["skipped"] == ranks[1]["skipped"] == expected
    assert ranks[0]["held"] == ranks[1]["held"] == [9, 10]


def test_without_lag_no_snapshot_is_skipped(tmp_path):
    ranks = run_ranks(tmp_path, lag_until=1)
    assert ranks[0]["skipped"] == ranks[1]["skipped"] == [False] * 10
