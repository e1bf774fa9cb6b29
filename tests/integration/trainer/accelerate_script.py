"""A tiny GPT-2 (built from a config, nothing downloaded) trained in a plain Hugging Face
Accelerate loop on CPU (DDP over gloo), one process per rank (RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT set), checkpointed every step by gemini_trainer.

Prints `restored step <n>` when it resumes, and `step <n> loss <float hex>` per step (this
rank's loss). The loader shuffles per epoch (12 samples, 2 ranks x 2 a batch: 3 steps an
epoch) and the model has dropout.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import torch
from accelerate import Accelerator, DataLoaderConfiguration
from torch.utils.data import DataLoader
from transformers import GPT2Config, GPT2LMHeadModel

from gemini_trainer import Checkpointer
from gemini_trainer.hf_accelerate import resumed_batches


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--unseeded-sampler", action="store_true", help="Accelerate's default one")
    args = p.parse_args(argv)
    # the seedable sampler: each epoch's order from (seed, epoch), so a restart can redo it
    seedable = DataLoaderConfiguration(use_seedable_sampler=not args.unseeded_sampler)
    accelerator = Accelerator(cpu=True, dataloader_config=seedable)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2,
                                       n_head=4))
    tokens = torch.randint(0, 64, (12, 16), generator=torch.Generator().manual_seed(7))
    samples: Any = list(tokens)  # a list is a map-style dataset
    loader: DataLoader[torch.Tensor] = DataLoader(samples, batch_size=2, shuffle=True)  # 3 steps
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.2, total_iters=4)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)

    ckpt = Checkpointer(model, optimizer, scheduler)  # GEMINI 1/4
    start = ckpt.restore() or 0  # GEMINI 2/4
    if start:
        print(f"restored step {start}", flush=True)
    model.train()
    for step, batch in enumerate(resumed_batches(accelerator, loader, start, args.epochs),
                                 start):  # GEMINI 3/4: the batches from the restored step on
        loss = model(input_ids=batch, labels=batch).loss
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        print(f"step {step + 1} loss {loss.item().hex()}", flush=True)
        ckpt.snapshot(step + 1)  # GEMINI 4/4
        time.sleep(args.step_sleep)
    ckpt.close()
    accelerator.end_training()
    return 0


if __name__ == "__main__":
    sys.exit(main())
