"""The restore path of a Checkpointer: ``Restorer`` waits for the version the launcher named
(or agrees with every rank on the newest complete one), checks it, loads it into the model,
optimizer and RNGs, and drops the abandoned run's newer versions from the slot file.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from gemini.slots.layout import SlotBusy, SlotError, SlotInfo
from gemini.slots.shard import ShardSlots
from gemini_trainer import timeline
from gemini_trainer.capture import (
    StateAdapter,
    Tree,
    decode_tree,
    owned,
    restore_rng,
    tensor_view,
)
from gemini_trainer.checkpointer_config import CheckpointerConfig, RestoreError, RestoreInstruction
from gemini_trainer.node_shard import region_payload
from gemini_trainer.payload import read_payload

log = logging.getLogger("gemini_trainer.checkpointer")  # the name its records always had


class Restorer:
    """Loads one rank's designated version from its slot file (see the checkpointer's module
    docstring). ``open_slots`` opens the existing slot file, once, for the checkpointer and
    this restorer alike."""

    def __init__(self, config: CheckpointerConfig, adapter: StateAdapter, path: Path,
                 open_slots: Callable[[], ShardSlots]) -> None:
        self.config = config
        self.adapter = adapter
        self.path = path
        self._open_slots = open_slots
        self.extra_state: Tree = None  # the user's extra state, after restore()
        self.restored_seq = 0  # a restored version is on every holder by construction

    def restore(self, instr: RestoreInstruction) -> int | None:
        """Load the designated version; returns its step, or None for a fresh start."""
        if instr.latest:
            version = self._agree_latest()
            if version is None:
                return None  # no version complete on every rank: a fresh start
        elif instr.version is None:
            return None
        else:
            version = instr.version
        slots = self._open_for_restore(instr)
        info = self._wait_for(slots, version, instr.timeout_s, instr.source)
        step = self._load(slots, info)
        self.restored_seq = info.seq
        log.info("restored step %d from %s (epoch %d)", step, instr.source, instr.epoch)
        timeline.mark(f"restored step {step}")
        if self.config.local_rank == 0:  # one process of the node cleans up
            self._drop_abandoned(slots, info.version)
        return step

    def _drop_abandoned(self, slots: ShardSlots, version: int) -> None:
        try:
            dropped = slots.drop_newer_than(version)
        except SlotBusy as err:  # the sidecar is writing the file (a fetch or an S3 restore)
            log.warning("versions newer than %d stay in %s: %s", version, self.path, err)
            return
        if dropped:
            log.info("dropped versions %s of the abandoned run from %s", dropped, self.path)

    def _open_for_restore(self, instr: RestoreInstruction) -> ShardSlots:
        deadline = time.monotonic() + instr.timeout_s
        while not self.path.exists():
            if time.monotonic() > deadline:
                raise RestoreError(
                    f"{self.path} does not exist after {instr.timeout_s:.0f}s: no checkpoint of "
                    f"rank {self.config.rank} in shared memory (source {instr.source}); has the "
                    "sidecar placed it? Check GEMINI_SHM_DIR and GEMINI_JOB"
                )
            time.sleep(0.05)
        return self._open_slots()

    def _agree_latest(self) -> int | None:
        """The newest version complete here and on every other rank (all-gather), or None."""
        mine: list[int] = []
        if self.path.exists():
            mine = sorted(i.version for i in self._open_slots().slot_info() if i.complete)
        common = set(mine)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            everyone: list[Any] = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(everyone, mine)
            common = common.intersection(*[set(v) for v in everyone])
        return max(common) if common else None

    def _wait_for(self, slots: ShardSlots, version: int, timeout: float, source: str) -> SlotInfo:
        deadline = time.monotonic() + timeout
        while (info := slots.find(version)) is None:
            if time.monotonic() > deadline:
                held = [(i.version, i.state.name) for i in slots.slot_info()]
                raise RestoreError(
                    f"version {version} of rank {self.config.rank} is not complete in "
                    f"{self.path} after {timeout:.0f}s (slots hold {held}; source {source})"
                )
            time.sleep(0.05)
        return info

    def _load(self, slots: ShardSlots, info: SlotInfo) -> int:
        payload = self._own_payload(slots, info)
        try:
            entries, views, skeleton = read_payload(payload)
            tensors = [
                tensor_view(views[f"t{i}"], entries[f"t{i}"].dtype, entries[f"t{i}"].shape)
                for i in range(len(entries))
            ]
            tree = decode_tree(skeleton, tensors)
            self._check_identity(tree, info)
            self.adapter.load(tree["state"])
            self.extra_state = owned(tree["extra"])
            restore_rng(tree["rng"])
            step = int(tree["step"])
            del tree, tensors, views, entries
        finally:
            payload.release()
        if not slots.still_valid(info):
            raise RestoreError(
                f"version {info.version} in {self.path} was overwritten while it was being "
                "restored; only one writer may use the slots during a restore"
            )
        return step

    def _own_payload(self, slots: ShardSlots, info: SlotInfo) -> memoryview:
        """This process's payload, checked: the slot's, or its region of the node's."""
        local_world = self.config.local_world_size
        if local_world == 1:
            return slots.read(info.version, verify=True)
        node_payload = slots.read(info.version)
        try:
            return region_payload(node_payload, self.config.local_rank, local_world)
        except SlotError as err:
            raise RestoreError(f"version {info.version} in {self.path}: {err}") from err

    def _check_identity(self, tree: Tree, info: SlotInfo) -> None:
        want = (self.adapter.kind, self.config.rank, self.config.world_size)
        got = (tree["kind"], tree["rank"], tree["world_size"])
        if want != got:
            raise RestoreError(
                f"version {info.version} in {self.path} was written by (kind, rank, world size)"
                f" {got}, this trainer is {want}: the launcher pointed at the wrong shard"
            )
