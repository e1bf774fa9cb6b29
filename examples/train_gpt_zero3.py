"""A small GPT trained with DeepSpeed ZeRO-3 (or ZeRO-1/2 with --zero-stage, optionally with
--offload-optimizer; or PyTorch DDP / FSDP2) on CPU with gloo, checkpointed into memory every
iteration by gemini_trainer.

Run one process per rank with RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT set (no
deepspeed launcher needed; LOCAL_WORLD_SIZE may be set too, for several ranks per node), or
under `gemini launch -- python examples/train_gpt_zero3.py`.
Data is a pure function of (seed, step, rank), so two runs see the same batches. Each rank
prints one line per step: `step <n> loss <float hex>` (exact, for comparing runs).

The GEMINI part is four lines, marked below, and `run(main)` at the end, which lets a
process that survives a failure restart in place (gemini_trainer.inprocess).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from gemini_trainer import Checkpointer, run


class Block(nn.Module):
    def __init__(self, d: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        att = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            is_causal=True,
            dropout_p=self.dropout if self.training else 0.0,
        )
        x = x + self.drop(self.proj(att.transpose(1, 2).reshape(b, t, d)))
        out: torch.Tensor = x + self.drop(self.mlp(self.ln2(x)))
        return out


class GPT(nn.Module):
    def __init__(
        self, vocab: int, seq: int, d: int, layers: int, heads: int, dropout: float
    ) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads, dropout) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)
        self.drop = nn.Dropout(dropout)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device)))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def batch(args: argparse.Namespace, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic data: a pure function of (seed, step, rank)."""
    gen = torch.Generator().manual_seed(args.seed * 1_000_003 + step * 1009 + rank)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine", choices=["deepspeed", "ddp", "fsdp2"], default="deepspeed")
    p.add_argument("--zero-stage", type=int, choices=[1, 2, 3], default=3,
                   help="DeepSpeed ZeRO stage (--engine deepspeed)")
    p.add_argument("--offload-optimizer", action="store_true",
                   help="DeepSpeed: keep the optimizer state and step on the CPU (ZeRO-Offload)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds to idle per step")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="cuda: one GPU per process (LOCAL_RANK), NCCL instead of gloo")
    return p.parse_args(argv)


def deepspeed_config(args: argparse.Namespace) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": args.zero_stage}
    if args.zero_stage == 3:
        # persistence threshold 0: even this small model is really partitioned and gathered
        zero["stage3_param_persistence_threshold"] = 0
    if args.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu"}
    return {
        "train_micro_batch_size_per_gpu": args.batch,
        "gradient_accumulation_steps": 1,
        "zero_optimization": zero,
        # torch's Adam, also on offloaded state (DeepSpeedCPUAdam would need a C++ build)
        "optimizer": {"type": "Adam", "params": {"lr": args.lr, "torch_adam": True}},
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_num_steps": 5, "warmup_max_lr": args.lr},
        },
        "steps_per_print": 10**9,
    }


def build(args: argparse.Namespace) -> tuple[Any, Any, Any]:
    """Returns (target, optimizer, scheduler) for Checkpointer, with the train step inside."""
    torch.manual_seed(args.seed)
    model = GPT(args.vocab, args.seq, args.d_model, args.layers, args.heads, args.dropout)
    backend = "gloo"
    if args.device == "cuda":  # the launcher gives each process of a node its LOCAL_RANK
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        model, backend = model.to("cuda"), "nccl"
    if args.engine == "deepspeed":
        import deepspeed

        os.environ.setdefault("LOCAL_RANK", os.environ.get("RANK", "0"))
        deepspeed.init_distributed(dist_backend=backend)
        engine, _, _, _ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=deepspeed_config(args)
        )
        return engine, None, None
    torch.distributed.init_process_group(backend)
    if args.engine == "ddp":
        ddp: nn.Module = nn.parallel.DistributedDataParallel(model)
        optimizer = torch.optim.AdamW(ddp.parameters(), lr=args.lr)
        scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.2, total_iters=5)
        return ddp, optimizer, scheduler
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.2, total_iters=5)
    return model, optimizer, scheduler


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    rank = int(os.environ.get("RANK", "0"))
    target, optimizer, scheduler = build(args)
    ckpt = Checkpointer(target, optimizer, scheduler)  # GEMINI 1/4: wrap what you train
    start = ckpt.restore() or 0  # GEMINI 2/4: the step to resume from (None: fresh start)
    if start:
        print(f"restored step {start} extra {ckpt.extra_state}", flush=True)
    for step in range(start, args.steps):
        x, y = (t.to(args.device) for t in batch(args, step, rank))
        if args.engine == "deepspeed":
            loss = target(x, y)
            target.backward(loss)
            target.step()
        else:
            loss = target(x, y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
        print(f"step {step + 1} loss {loss.item().hex()}", flush=True)
        ckpt.snapshot(step + 1, extra={"next_batch": step + 1})  # GEMINI 3/4: every iteration
        if args.step_sleep:
            time.sleep(args.step_sleep)
    ckpt.close()  # GEMINI 4/4: wait for the last commit
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(run(main))  # in-process restarts: main() runs again in this process
