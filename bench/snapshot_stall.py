"""Snapshot stall vs a plain memory copy of the same bytes into a preallocated buffer.

Builds a model + Adam (fp32 weights and two moments: ~12 bytes per parameter, as a ZeRO-3
shard), takes one optimizer step so the state exists, then measures in the same run:

- stall: ``Checkpointer.snapshot(step)`` as the training loop sees it (capture, layout, copy of
  every tensor into the free shared-memory slot), with the previous commit already finished
  (in training an iteration separates two snapshots; the commit time is reported beside it);
- baseline (the figure's denominator): a plain memcpy (numpy.copyto) of the same bytes, the
  state's tensors where they live, into a preallocated, already-touched buffer;
- for reference: one memcpy of a single contiguous source of the same size (the faster of
  numpy.copyto and torch's copy_), which also hides that the state is many tensors.

They alternate, and each figure is the median over runs of stall / copy of the same run, so
both see the same load on a shared machine.

Usage: .venv/bin/python bench/snapshot_stall.py [--params-m 32] [--runs 15]
The last line is the JSON result (target: stall <= 1.5 x copy).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from gemini_trainer.capture import capture_rng, encode_tree
from gemini_trainer.checkpointer import Checkpointer, CheckpointerConfig


def build(params_m: float, width: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    layers = max(1, round(params_m * 1e6 / (width * width + width)))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(2, width)).sum().backward()
    opt.step()
    return model, opt


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


class Baselines:
    """Plain copies into preallocated, touched buffers (not freshly allocated memory)."""

    def __init__(self, tensors: list[torch.Tensor], nbytes: int) -> None:
        self.sources = [t.reshape(-1).view(torch.uint8).numpy() for t in tensors]
        self.dst = np.ones(nbytes, dtype=np.uint8)
        self.src = np.random.default_rng(0).integers(0, 255, size=nbytes, dtype=np.uint8)
        self.times: dict[str, list[float]] = {"same": [], "numpy.copyto": [], "torch.copy_": []}

    def _same_bytes(self) -> None:
        offset = 0
        for src in self.sources:
            np.copyto(self.dst[offset : offset + src.nbytes], src)
            offset += src.nbytes

    def measure(self) -> None:
        self.times["same"].append(timed(self._same_bytes))
        self.times["numpy.copyto"].append(timed(lambda: np.copyto(self.dst, self.src)))
        td, ts = torch.from_numpy(self.dst), torch.from_numpy(self.src)
        self.times["torch.copy_"].append(timed(lambda: td.copy_(ts)))

    def contiguous(self) -> list[float]:
        """Per-run times of the faster single contiguous copy method."""
        names = ("numpy.copyto", "torch.copy_")
        best = min(names, key=lambda k: statistics.median(self.times[k]))
        return self.times[best]


def paired_median(stalls: list[float], copies: list[float]) -> float:
    return statistics.median(s / c for s, c in zip(stalls, copies, strict=True))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params-m", type=float, default=32.0, help="millions of parameters")
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--shm-dir", type=Path, default=Path("/dev/shm"))
    args = ap.parse_args()

    model, opt = build(args.params_m, args.width)
    n_params = sum(p.numel() for p in model.parameters())
    with tempfile.TemporaryDirectory(dir=args.shm_dir, prefix="gemini-bench-") as tmp:
        config = CheckpointerConfig(rank=0, world_size=1, shm_dir=Path(tmp), profile_iterations=0)
        ckpt = Checkpointer(model, opt, config=config)
        _, tensors = encode_tree({"state": ckpt.adapter.capture(), "rng": capture_rng()})
        nbytes = sum(t.nbytes for t in tensors)
        base = Baselines(tensors, nbytes)
        stalls, commits = [], []
        for step in range(1, args.runs + 3):
            stall = ckpt.snapshot(step).stall_s
            commit = timed(ckpt.flush)
            base.measure()
            if step > 2:  # the first write of each slot and of the baseline is warm-up
                stalls.append(stall)
                commits.append(commit)
        assert not ckpt.errors, list(ckpt.errors)
        ckpt.close()
    same, contiguous = base.times["same"][2:], base.contiguous()[2:]
    ratio = paired_median(stalls, same)
    gib = nbytes / 2**30
    ms = statistics.median
    print(
        f"{n_params / 1e6:.1f}M parameters, {len(tensors)} tensors, {gib:.3f} GiB; median ms: "
        f"snapshot stall {ms(stalls) * 1e3:.1f}, memcpy of the same tensors "
        f"{ms(same) * 1e3:.1f}, one contiguous memcpy {ms(contiguous) * 1e3:.1f}, "
        f"background commit (CRC-32) {ms(commits) * 1e3:.1f}; stall / contiguous memcpy "
        f"{paired_median(stalls, contiguous):.3f}"
    )
    result = {
        "metric": "snapshot_stall_over_memcpy_of_same_bytes",
        "value": round(ratio, 3),
        "target": 1.5,
        "better": "lower",
        "unit": "ratio",
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
