"""CUDA snapshots: the stall the training loop sees, and the copy rate against pinned D2H.

For each shard size (default 1, 4 and 16 GiB: fp32 parameters and Adam's two moments on the
GPU, 12 bytes per parameter) a loop of iterations of about ``--iteration-s`` seconds (matmuls
standing in for forward and backward, then the optimizer step) runs with and without a
``Checkpointer.snapshot`` per iteration, alternating, in the same run:

- stall = (median iteration with snapshots - median without) / median without, the share of
  the iteration the snapshots cost the loop (target <= 5%);
- copy rate = shard bytes / (time from the snapshot call until its copy is in shared memory),
  over the pinned device-to-host bandwidth measured here with ``copy_`` of the same bytes into
  a page-locked buffer (target >= 0.8).

Without a GPU it prints why and a JSON line with ``"skipped": "no GPU"``.
Usage: .venv/bin/python bench/gpu_snapshot.py [--sizes-gib 1,4,16] [--iterations 6]
The last line is one JSON object (the worst stall over the sizes).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from gemini_trainer.checkpointer import Checkpointer
from gemini_trainer.checkpointer_config import CheckpointerConfig

GIB = 1 << 30


def result(value: float | None, **extra: Any) -> dict[str, Any]:
    return {"metric": "gpu_snapshot_stall_share_of_iteration_worst_size", "value": value,
            "target": 0.05, "better": "lower", "unit": "ratio", **extra}


def pinned_d2h_gib_s(nbytes: int) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    rates = []
    for _ in range(3):
        torch.cuda.synchronize()
        start = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        rates.append(nbytes / GIB / (time.perf_counter() - start))
    del src, dst
    return statistics.median(rates)


class Workload:
    """Parameters and Adam state of ``nbytes`` on the GPU, and an iteration of ~target_s."""

    def __init__(self, nbytes: int, target_s: float) -> None:
        count = nbytes // 12
        chunk = 1 << 26
        self.params = [torch.nn.Parameter(torch.randn(min(chunk, count - i), device="cuda"))
                       for i in range(0, count, chunk)]
        for p in self.params:
            p.grad = torch.randn_like(p) * 1e-3
        self.opt = torch.optim.Adam(self.params, lr=1e-4)
        self.opt.step()  # the moments exist from here on
        self.module = torch.nn.ParameterList(self.params)
        self.a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        self.out = torch.empty_like(self.a)
        self.matmuls = self._calibrate(target_s)

    def _calibrate(self, target_s: float) -> int:
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(10):
            torch.mm(self.a, self.a, out=self.out)  # stands in for forward and backward
        torch.cuda.synchronize()
        return max(1, round(target_s / ((time.perf_counter() - start) / 10)))

    def iteration(self) -> None:
        for _ in range(self.matmuls):
            torch.mm(self.a, self.a, out=self.out)
        self.opt.step()


def iteration_times(work: Workload, ckpt: Checkpointer | None, steps: int) -> list[float]:
    times = []
    for step in range(steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        work.iteration()
        if ckpt is not None:
            ckpt.snapshot(step + 1)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return times


def copy_seconds(work: Workload, ckpt: Checkpointer, step: int) -> float:
    """Snapshot call until its bytes are in shared memory (the commit waits for them)."""
    ckpt.flush()
    torch.cuda.synchronize()
    start = time.perf_counter()
    ckpt.snapshot(step)
    ckpt.flush()
    return time.perf_counter() - start


def measure(size_gib: float, args: argparse.Namespace, shm: Path) -> dict[str, Any]:
    nbytes = int(size_gib * GIB)
    work = Workload(nbytes, args.iteration_s)
    config = CheckpointerConfig(rank=0, world_size=1, shm_dir=shm, profile_iterations=0)
    ckpt = Checkpointer(work.module, work.opt, config=config)
    iteration_times(work, ckpt, 3)  # both slots made and registered, the hook has seen Adam
    plain, with_snapshots = [], []
    for _ in range(2):
        plain += iteration_times(work, None, args.iterations)
        with_snapshots += iteration_times(work, ckpt, args.iterations)
    copies = [copy_seconds(work, ckpt, 1000 + i) for i in range(3)]
    assert not ckpt.errors, list(ckpt.errors)
    ckpt.close()
    pinned = pinned_d2h_gib_s(nbytes)
    base, loaded = statistics.median(plain), statistics.median(with_snapshots)
    copy_rate = nbytes / GIB / statistics.median(copies)
    return {"size_gib": size_gib, "iteration_s": round(base, 3),
            "stall_share": round((loaded - base) / base, 4),
            "copy_gib_s": round(copy_rate, 2), "pinned_d2h_gib_s": round(pinned, 2),
            "copy_over_pinned": round(copy_rate / pinned, 3)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-gib", default="1,4,16")
    ap.add_argument("--iterations", type=int, default=6)
    ap.add_argument("--iteration-s", type=float, default=1.0)
    ap.add_argument("--shm-dir", type=Path, default=Path("/dev/shm"))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device here: nothing to measure")
        print(json.dumps(result(None, skipped="no GPU")))
        return 0
    rows = []
    for size in (float(s) for s in args.sizes_gib.split(",")):
        with tempfile.TemporaryDirectory(dir=args.shm_dir, prefix="gemini-gpu-bench-") as tmp:
            rows.append(measure(size, args, Path(tmp)))
        print(json.dumps(rows[-1]), flush=True)
        torch.cuda.empty_cache()
    print(f"GPU: {torch.cuda.get_device_name()}; copy / pinned D2H target >= 0.8: "
          f"{[r['copy_over_pinned'] for r in rows]}")
    print(json.dumps(result(max(r["stall_share"] for r in rows),
                            device=torch.cuda.get_device_name(),
                            worst_copy_over_pinned=min(r["copy_over_pinned"] for r in rows))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
