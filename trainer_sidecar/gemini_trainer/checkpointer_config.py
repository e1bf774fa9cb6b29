"""The checkpointer's settings: what the launcher asks ``restore()`` for (``RestoreInstruction``),
the rank's place and the slot file's size and budget (``CheckpointerConfig``), both read from
the environment, and the check that the memory budget holds a node's checkpoint
(``check_budget``). No torch: the settings are plain values.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gemini.slots.layout import SlotError


class RestoreError(Exception):
    """The designated version cannot be restored; the message says what is missing."""


@dataclass(frozen=True)
class RestoreInstruction:
    """What the launcher asked for: no version (fresh start), a version, or ``latest``."""

    version: int | None
    latest: bool = False
    source: str = "local"  # local | peer | s3: where the sidecar got it (for the record)
    epoch: int = 0  # GEMINI_RESTART_EPOCH
    timeout_s: float = 60.0

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> RestoreInstruction:
        env = os.environ if env is None else env
        raw = env.get("GEMINI_RESTORE_VERSION", "").strip().lower()
        source = env.get("GEMINI_RESTORE_SOURCE", "local") or "local"
        epoch = int(env.get("GEMINI_RESTART_EPOCH", "0") or 0)
        timeout = float(env.get("GEMINI_RESTORE_TIMEOUT_S", "60") or 60)
        if raw in ("", "none"):
            return cls(None, False, source, epoch, timeout)
        if raw == "latest":
            return cls(None, True, source, epoch, timeout)
        try:
            version = int(raw)
        except ValueError as err:
            raise RestoreError(
                f"GEMINI_RESTORE_VERSION={raw!r}: use a step number, 'latest' or 'none'"
            ) from err
        return cls(version, False, source, epoch, timeout)


@dataclass(frozen=True)
class CheckpointerConfig:
    rank: int
    world_size: int
    shm_dir: Path
    job: str = ""
    capacity_bytes: int | None = None  # None: first snapshot's size + checkpointer.HEADROOM_BYTES
    sidecar_url: str | None = None
    auth_token: str = field(default="", repr=False)
    heartbeat_file: Path | None = None
    profile_iterations: int = 20  # iterations of communication to profile; 0: none
    local_rank: int = 0
    local_world_size: int = 1  # training processes on this node, one slot file for all
    node_rank: int | None = None  # the slot file's (and sidecar's) rank; None: ``rank``
    memory_budget_bytes: int | None = None  # checkpoint memory per node (GeminiJob spec)
    replicas: int = 0  # m, copies of each node's checkpoint (0: unknown)

    def __post_init__(self) -> None:
        if self.local_world_size > 1 and self.rank != self.node * self.local_world_size + (
                self.local_rank):
            raise ValueError(
                f"rank {self.rank} is not node rank {self.node} x {self.local_world_size} local "
                f"processes + local rank {self.local_rank}: ranks must be numbered node by node"
            )

    @property
    def node(self) -> int:
        return self.rank if self.node_rank is None else self.node_rank

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> CheckpointerConfig:
        env = os.environ if env is None else env

        def pick(*names: str, default: str = "") -> str:
            return next((env[n] for n in names if env.get(n)), default)

        capacity = pick("GEMINI_SHM_CAPACITY_BYTES")
        heartbeat = pick("GEMINI_HEARTBEAT_FILE")
        local_world = int(pick("LOCAL_WORLD_SIZE", default="1"))
        if local_world > 1:  # the launcher's per-process ranks; GEMINI_RANK is the node's
            ranks: dict[str, Any] = {
                "rank": int(pick("RANK", default="0")),
                "world_size": int(pick("WORLD_SIZE", default="1")),
                "local_rank": int(pick("LOCAL_RANK", default="0")),
                "local_world_size": local_world,
                "node_rank": int(pick("GEMINI_RANK", "NODE_RANK", default="0")),
            }
        else:
            ranks = {"rank": int(pick("GEMINI_RANK", "RANK", default="0")),
                     "world_size": int(pick("GEMINI_WORLD_SIZE", "WORLD_SIZE", default="1"))}
        budget = pick("GEMINI_MEMORY_BUDGET_BYTES")
        return cls(
            **ranks,
            memory_budget_bytes=int(budget) if budget else None,
            replicas=int(pick("GEMINI_REPLICAS", default="0")),
            shm_dir=Path(pick("GEMINI_SHM_DIR", default="/dev/shm")),
            job=pick("GEMINI_JOB"),
            capacity_bytes=int(capacity) if capacity else None,
            sidecar_url=pick("GEMINI_SIDECAR_URL") or None,
            auth_token=pick("GEMINI_AUTH_TOKEN"),
            heartbeat_file=Path(heartbeat) if heartbeat else None,
            profile_iterations=int(pick("GEMINI_PROFILE_ITERATIONS", default="20")),
        )



def check_budget(config: CheckpointerConfig, capacity: int) -> None:
    """Refuse, before the first snapshot is written, a node checkpoint the memory budget
    cannot hold: two versions in the node's slot file (the shared tmpfs is the budget's size),
    and two of each of the m-1 peers' checkpoints a sidecar holds."""
    budget = config.memory_budget_bytes
    if not budget:
        return
    copies = 2 * max(1, config.replicas - 1)
    if copies * capacity <= budget:
        return
    procs = config.local_world_size
    whose = ("this rank's checkpoint" if procs == 1 else
             f"this node's checkpoint ({procs} processes' shards, numProcPerNode)")
    raise SlotError(
        f"{whose} needs {capacity} bytes per version, so {copies} versions ({copies * capacity}"
        f" bytes: two in the slot file, and two of each of the m-1 = {max(0, config.replicas - 1)}"
        f" peers' a sidecar holds) but spec.checkpoint.memoryBudgetPerNode is {budget} bytes; "
        "raise it (and the sidecar's memory limit), or use fewer processes per node or replicas"
    )
