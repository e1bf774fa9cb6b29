"""Trainer integration: snapshot/restore library, the slots' payload codec and the launcher.

``Checkpointer`` (and everything that imports torch) is loaded on first use, so the launcher
can import ``gemini_trainer.launcher`` (and tools ``gemini_trainer.payload``) without torch.
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
