"""Trainer integration: snapshot/restore library, shared-memory slots and the launcher.

``Checkpointer`` (and everything that imports torch) is loaded on first use, so the sidecar and
the launcher can import ``gemini_trainer.shm`` and ``gemini_trainer.launcher`` without torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gemini_trainer.checkpointer import Checkpointer, RestoreError, RestoreInstruction
    from gemini_trainer.inprocess import run

__all__ = ["Checkpointer", "RestoreError", "RestoreInstruction", "run"]


def __getattr__(name: str) -> Any:
    if name == "run":  # no torch needed
        from gemini_trainer import inprocess

        return inprocess.run
    if name in __all__:
        from gemini_trainer import checkpointer

        return getattr(checkpointer, name)
    raise AttributeError(f"module 'gemini_trainer' has no attribute {name!r}")
