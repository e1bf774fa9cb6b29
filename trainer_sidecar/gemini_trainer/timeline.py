"""Where a restarted attempt's time went, from the launcher's restart order: the launcher puts
the order's unix time in GEMINI_RESTART_UNIX, and the Checkpointer prints
``gemini: restart timeline: <event> <s> s after the restart order`` to stderr when the attempt
is built (process group, model, engine), restored, and done with its first step. The operator's
`trainer_restart` phase is the sum; these lines split it in the trainer's own log."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Mapping

ENV = "GEMINI_RESTART_UNIX"
_printed: set[tuple[str, str]] = set()  # (order, event): each once per attempt


def mark(event: str, env: Mapping[str, str] | None = None) -> float | None:
    """Print (once per restart order) how long after the order `event` came; its seconds."""
    raw = (os.environ if env is None else env).get(ENV, "")
    try:
        ordered = float(raw)
    except ValueError:
        return None
    if (raw, event) in _printed:
        return None
    _printed.add((raw, event))
    after = time.time() - ordered
    print(f"gemini: restart timeline: {event} {after:.2f} s after the restart order",
          file=sys.stderr, flush=True)
    return after
