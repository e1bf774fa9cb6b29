"""examples/train_gpt_zero3.py with a larger checkpoint shard: every snapshot carries
TEST_SHARD_PADDING_BYTES extra bytes (random, fixed per rank) in its extra state (not GEMINI_:
the operator refuses env names it sets itself).

Run with the example's own arguments (`python tests/e2e/padded_trainer.py --steps 20 ...`);
in a container, TEST_EXAMPLE_SCRIPT says where the example is (a ConfigMap's file).
The padding makes replication cost what a test wants without more training traffic (a bigger
model would add both), and changes no loss: it is drawn from a generator of its own, never
from torch's, and training never reads it; losses equal the plain example's with the same
arguments.
"""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path
from typing import Any

PADDING_ENV = "TEST_SHARD_PADDING_BYTES"
EXAMPLE_ENV = "TEST_EXAMPLE_SCRIPT"  # where the example is, when not beside this checkout's
EXAMPLE = Path(os.environ.get(EXAMPLE_ENV)
               or Path(__file__).resolve().parents[2] / "examples" / "train_gpt_zero3.py")


def main() -> None:
    import numpy as np
    import torch

    from gemini_trainer import Checkpointer

    size = int(os.environ.get(PADDING_ENV, "0"))
    rank = int(os.environ.get("RANK", "0"))
    padding = torch.from_numpy(np.random.default_rng(rank).integers(0, 256, size, dtype=np.uint8))
    snapshot = Checkpointer.snapshot

    def padded(self: Checkpointer, step: int, extra: Any = None) -> Any:
        return snapshot(self, step, extra={**(extra or {}), "padding": padding})

    Checkpointer.snapshot = padded  # type: ignore[method-assign]
    sys.argv[0] = str(EXAMPLE)
    runpy.run_path(str(EXAMPLE), run_name="__main__")


if __name__ == "__main__":
    main()
