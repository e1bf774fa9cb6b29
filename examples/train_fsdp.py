"""The small GPT of train_gpt_zero3.py trained with PyTorch FSDP2 (`fully_shard`) on CPU with
gloo, checkpointed into memory every iteration by gemini_trainer.

FSDP2 shards every parameter (and with it the AdamW state) across the ranks as DTensors: each
`fully_shard` call below wraps one transformer block, the last one the whole model, so a
block's parameters are all-gathered only while it runs. gemini_trainer's Checkpointer takes
each rank's own shard (DTensor local tensors, the optimizer and LR scheduler), so a snapshot
costs one rank's share of the state, and a restore needs no gathering either.

The model, the data and the loop are train_gpt_zero3.py's (its `--engine fsdp2`), so the two
examples cannot drift apart; this script only fixes the engine. Run it like that one: one
process per rank with RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT set, or under
`gemini launch -- python examples/train_fsdp.py` (examples/geminijob-fsdp.yaml does so).
Every other option (--steps, --layers, --d-model, ...) is train_gpt_zero3.py's.
"""

from __future__ import annotations

import sys

# The script's own folder is first on sys.path when run as `python examples/train_fsdp.py`.
import train_gpt_zero3

from gemini_trainer import run


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if any(a == "--engine" or a.startswith("--engine=") for a in args):
        sys.exit("train_fsdp.py always trains with FSDP2: drop --engine (or run "
                 "train_gpt_zero3.py --engine deepspeed|ddp|fsdp2)")
    return int(train_gpt_zero3.main(["--engine", "fsdp2", *args]))


if __name__ == "__main__":
    sys.exit(run(main))  # in-process restarts: main() runs again in this process
