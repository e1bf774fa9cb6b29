"""A tiny GPT-2 (built from a config, nothing downloaded) fine-tuned with the Hugging Face
Trainer on CPU, one process per rank (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
MASTER_ADDR, MASTER_PORT set), checkpointed every step by gemini_trainer.hf.GeminiCallback.

Prints the Trainer's own record: `restored step <n>` when it starts from a restored step, and
`step <n> loss <float hex>` for each step it logs (logging_steps=1: the step's loss, averaged
over the ranks). The data is shuffled per epoch by the Trainer's sampler and the model has
dropout, so data order and RNG states matter.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

from gemini_trainer.hf import GeminiCallback


class Printer(TrainerCallback):  # type: ignore[misc]
    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step:  # GeminiCallback, added before, restored the Trainer's progress
            print(f"restored step {state.global_step} epoch {state.epoch}", flush=True)

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any
               ) -> None:
        if logs and "loss" in logs:
            print(f"step {state.global_step} loss {float(logs['loss']).hex()}", flush=True)


class Sleeper(TrainerCallback):  # type: ignore[misc]
    """Idle time after each step's line: room to be killed mid-run before the next snapshot
    (the one before the printed step is complete by then); changes no computation."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_log(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        time.sleep(self.seconds)


def dataset(size: int, seq: int, vocab: int) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, vocab, (size, seq), generator=gen)
    return [{"input_ids": t, "labels": t} for t in tokens]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--output-dir", required=True)
    p.add_argument("--step-sleep", type=float, default=0.0)
    args = p.parse_args(argv)
    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=4)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)
    training = TrainingArguments(
        output_dir=args.output_dir, use_cpu=True, ddp_backend="gloo", seed=11,
        max_steps=args.steps, per_device_train_batch_size=2, gradient_accumulation_steps=2,
        learning_rate=1e-3, warmup_steps=2, logging_steps=1, save_strategy="no",
        report_to="none", disable_tqdm=True, dataloader_num_workers=0,
    )
    # 24 samples, 2 ranks x 2 per batch x 2 accumulated: 3 optimizer steps per epoch
    trainer = Trainer(model=model, args=training, train_dataset=dataset(24, 16, 64))
    trainer.add_callback(GeminiCallback(trainer))  # GEMINI: restore at start, snapshot per step
    trainer.add_callback(Printer())
    if args.step_sleep:
        trainer.add_callback(Sleeper(args.step_sleep))
    trainer.train()
    # The Trainer leaves its gloo group to interpreter exit, where its threads can abort the
    # process ("terminate called without an active exception", seen under CI load).
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    # Exit without the interpreter's teardown: C++ threads of torch and gloo still destroyed
    # there aborted a rank that had finished every step (-6, "terminate called without an
    # active exception") in two CI runs, even after destroy_process_group().
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
