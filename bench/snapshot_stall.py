"""Snapshot stall vs a plain memory copy of the same bytes into a preallocated buffer.

Builds a model + Adam (fp32 weights and two moments: ~12 bytes per parameter, as a ZeRO-3
shard), takes one optimizer step so the state exists, then measures in the same run:

- stall: ``Checkpointer.snapshot(step)`` as the training loop sees it (capture, layout, copy of
  every tensor into the free shared-memory slot), with the previous commit already finished
  (in training an iteration separates two snapshots; the commit time is reported beside it);
- baseline (the figure's denominator): a plain copy of the same bytes, the state's tensors
  where they live, into a preallocated, already-touched buffer (the faster of a numpy memcpy
  per tensor and torch's copy_ per tensor, which is parallel on CPU);
- for reference: one memcpy of a single contiguous source of the same size (the faster of
  numpy.copyto and torch's copy_), which also hides that the state is many tensors.

They alternate, and each figure is the median over runs of stall / copy of the same run, so
both see the same load on a shared machine.

With ``--device cuda`` the state lives on the GPU and every copy is device to host. With
``--procs N`` N processes of one node (gloo) snapshot together into one slot file, as with
numProcPerNode N (gemini_trainer.node_shard), and copy together for the baseline; the figure
is the worst process's.

Usage: .venv/bin/python bench/snapshot_stall.py [--params-m 32] [--runs 15] [--device cuda]
       [--procs 4]
The last line is the JSON result (target: stall <= 1.5 x copy).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gemini_trainer.capture import capture_rng, encode_tree
from gemini_trainer.checkpointer import Checkpointer
from gemini_trainer.checkpointer_config import CheckpointerConfig
from gemini_trainer.snapshot_copy import CopyMethod


def build(
    params_m: float, width: int, device: str = "cpu"
) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    layers = max(1, round(params_m * 1e6 / (width * width + width)))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    model = model.to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(2, width, device=device)).sum().backward()
    opt.step()
    return model, opt


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


class Baselines:
    """Plain copies into preallocated, touched buffers (not freshly allocated memory)."""

    def __init__(self, tensors: list[torch.Tensor], nbytes: int, device: str) -> None:
        self.device = device
        self.sources = [t.reshape(-1).view(torch.uint8) for t in tensors]
        self.dst = np.ones(nbytes, dtype=np.uint8)
        src = np.random.default_rng(0).integers(0, 255, size=nbytes, dtype=np.uint8)
        self.src = torch.from_numpy(src).to(device)
        self.times: dict[str, list[float]] = {
            "same numpy.copyto": [],
            "same torch.copy_": [],
            "numpy.copyto": [],
            "torch.copy_": [],
        }

    def _same_bytes(self, use_numpy: bool) -> None:
        offset = 0
        for src in self.sources:
            dst = self.dst[offset : offset + src.nbytes]
            if use_numpy:  # one single-threaded memcpy per tensor
                np.copyto(dst, src.numpy())
            else:  # parallel on CPU, device to host for GPU tensors
                torch.from_numpy(dst).copy_(src)
            offset += src.nbytes

    def measure(self) -> None:
        self.times["same torch.copy_"].append(timed(lambda: self._same_bytes(False)))
        if self.device == "cpu":
            self.times["same numpy.copyto"].append(timed(lambda: self._same_bytes(True)))
        td = torch.from_numpy(self.dst)
        self.times["torch.copy_"].append(timed(lambda: td.copy_(self.src)))
        if self.device == "cpu":
            src = self.src.numpy()
            self.times["numpy.copyto"].append(timed(lambda: np.copyto(self.dst, src)))

    def fastest(self, *names: str) -> tuple[str, list[float]]:
        """The method with the lowest median among ``names``, and its per-run times."""
        best = min((k for k in names if self.times[k]), key=lambda k: ms(self.times[k]))
        return best, self.times[best]


def ms(times: list[float]) -> float:
    return statistics.median(times)


def paired_median(stalls: list[float], copies: list[float]) -> float:
    return statistics.median(s / c for s, c in zip(stalls, copies, strict=True))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params-m", type=float, default=None,
                    help="millions of parameters per process (default 32 / --procs)")
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--shm-dir", type=Path, default=Path("/dev/shm"))
    ap.add_argument("--device", default="cpu", help="where the model lives (cpu, cuda)")
    ap.add_argument("--procs", type=int, default=1,
                    help="training processes on this node, writing one slot file together")
    ap.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.params_m is None:
        args.params_m = 32.0 / args.procs
    if args.worker is not None:
        print(json.dumps(measure(args)), flush=True)
        return 0
    results = [measure(args)] if args.procs == 1 else run_workers(args)
    for res in results:
        print(res["summary"])
    result = {
        "metric": "snapshot_stall_over_memcpy_of_same_bytes"
                  + ("" if args.procs == 1 else f"_worst_of_{args.procs}_processes"),
        "value": max(res["ratio"] for res in results),
        "target": 1.5,
        "better": "lower",
        "unit": "ratio",
    }
    print(json.dumps(result))
    return 0


def run_workers(args: argparse.Namespace) -> list[dict[str, Any]]:
    """--procs N: N processes of one node (gloo on loopback), each measuring its own stall
    and copy, step by step together (a barrier before each), as training processes would."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory(dir=args.shm_dir, prefix="gemini-bench-") as tmp:
        procs = []
        for rank in range(args.procs):
            env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                   "RANK": str(rank), "WORLD_SIZE": str(args.procs)}
            cmd = [sys.executable, __file__, "--worker", str(rank), "--procs", str(args.procs),
                   "--params-m", str(args.params_m), "--width", str(args.width),
                   "--runs", str(args.runs), "--shm-dir", tmp, "--device", args.device]
            procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True))
        outputs = [p.communicate()[0] for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit(f"a worker failed: exit codes {[p.returncode for p in procs]}")
    return [json.loads(out.strip().splitlines()[-1]) for out in outputs]


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """One process's median stall / copy ratio (and a readable summary)."""
    local = args.worker is not None
    if local:
        torch.distributed.init_process_group("gloo")
    model, opt = build(args.params_m, args.width, args.device)
    n_params = sum(p.numel() for p in model.parameters())
    rank = args.worker or 0
    with contextlib.ExitStack() as stack:
        tmp = args.shm_dir if local else Path(stack.enter_context(
            tempfile.TemporaryDirectory(dir=args.shm_dir, prefix="gemini-bench-")))
        config = CheckpointerConfig(rank=rank, world_size=args.procs, shm_dir=Path(tmp),
                                    profile_iterations=0, local_rank=rank,
                                    local_world_size=args.procs, node_rank=0)
        ckpt = Checkpointer(model, opt, config=config)
        _, tensors = encode_tree({"state": ckpt.adapter.capture(), "rng": capture_rng()})
        nbytes = sum(t.nbytes for t in tensors)
        base = Baselines(tensors, nbytes, args.device)
        together = torch.distributed.barrier if local else (lambda: None)
        stalls, commits = [], []
        warmup = 2 + 2 * CopyMethod.CALIBRATION  # both slots, and the copy calibration
        for step in range(1, args.runs + warmup + 1):
            together()
            stall = ckpt.snapshot(step).stall_s
            commit = timed(ckpt.flush)
            together()
            base.measure()
            if step > warmup:
                stalls.append(stall)
                commits.append(commit)
        assert not ckpt.errors, list(ckpt.errors)
        ckpt.close()
    same_how, same = base.fastest("same numpy.copyto", "same torch.copy_")
    contiguous_how, contiguous = base.fastest("numpy.copyto", "torch.copy_")
    same, contiguous = same[warmup:], contiguous[warmup:]
    ratio = paired_median(stalls, same)
    gib = nbytes / 2**30
    summary = (
        f"{'' if not local else f'process {rank} of {args.procs}: '}"
        f"{n_params / 1e6:.1f}M parameters on {args.device}, {len(tensors)} tensors, "
        f"{gib:.3f} GiB; median ms: "
        f"snapshot stall {ms(stalls) * 1e3:.1f}, copy of the same tensors ({same_how}) "
        f"{ms(same) * 1e3:.1f}, one contiguous copy ({contiguous_how}) "
        f"{ms(contiguous) * 1e3:.1f}, "
        f"background commit (CRC-32) {ms(commits) * 1e3:.1f}; stall / contiguous memcpy "
        f"{paired_median(stalls, contiguous):.3f}; stall / copy {ratio:.3f}; numpy copy "
        f"chosen: {ckpt.copy_method.chosen}"
    )
    return {"ratio": round(ratio, 3), "summary": summary}


if __name__ == "__main__":
    raise SystemExit(main())
