"""The local shard: the slot file the trainer writes in shared memory (gemini.slots).

The sidecar reads what the trainer committed, to send it to peers and to serve fetches, and
writes a version fetched from a peer or S3 into it, so the restarted trainer restores from
shared memory as in any other recovery.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from gemini.slots.layout import SlotError, SlotInfo, default_capacity, shard_path
from gemini.slots.shard import ShardSlots


class LocalShardError(Exception):
    """The local slot file is missing, unreadable or does not hold the version asked for."""


class LocalShard:
    """Lazy handle on this rank's slot file (the trainer usually creates it)."""

    def __init__(self, shm_dir: Path, rank: int, job: str = "") -> None:
        self.path = shard_path(rank, shm_dir, job)
        self.rank = rank
        self._slots: ShardSlots | None = None
        self._inode = -1

    def _open(self) -> ShardSlots | None:
        if self._slots is not None and self._replaced():
            self.close()  # the trainer made a new file (new capacity): map that one
        if self._slots is None and self.path.exists():
            try:
                self._slots = ShardSlots(self.path)
                self._inode = os.stat(self.path).st_ino
            except (SlotError, ValueError, OSError):
                return None  # being created by the trainer right now; try again later
        return self._slots

    def _replaced(self) -> bool:
        try:
            return os.stat(self.path).st_ino != self._inode
        except FileNotFoundError:
            return True

    def slot_info(self) -> tuple[SlotInfo, ...]:
        """Both slots' headers, or nothing while there is no slot file."""
        slots = self._open()
        return slots.slot_info() if slots else ()

    def latest(self) -> SlotInfo | None:
        slots = self._open()
        return slots.latest_complete() if slots else None

    def find(self, version: int) -> SlotInfo | None:
        slots = self._open()
        return slots.find(version) if slots else None

    def read(self, version: int | None = None) -> tuple[SlotInfo, memoryview]:
        """A complete version (newest when None) and a read-only view of its payload."""
        slots = self._open()
        info = None
        if slots is not None:
            info = slots.latest_complete() if version is None else slots.find(version)
        if slots is None or info is None:
            raise LocalShardError(f"version {version} of rank {self.rank} not in {self.path}")
        return info, slots.read(info.version)

    def acknowledge(self, info: SlotInfo) -> None:
        """Tell the trainer that every holder has `info`'s version: its older slot may go."""
        slots = self._open()
        if slots is not None and slots.still_valid(info):
            slots.acknowledge(info.seq)

    def pin(self, info: SlotInfo) -> bool:
        """Ask the trainers to keep `info`'s version (a persist reads it); False when it is
        gone already. Checked after pinning: a version replaced meanwhile is not kept."""
        slots = self._open()
        if slots is None:
            return False
        slots.pin(info.seq)
        if slots.still_valid(info):
            return True
        self.unpin(info)
        return False

    def unpin(self, info: SlotInfo | None = None) -> None:
        """Release `info`'s pin (None: whatever is pinned, as a restarted sidecar does: no
        upload of its own runs yet)."""
        slots = self._open()
        if slots is not None and (info is None or slots.pinned_seq == info.seq):
            slots.pin(0)

    def acknowledged_seq(self) -> int:
        slots = self._open()
        return slots.acknowledged_seq if slots else 0

    def still_valid(self, info: SlotInfo) -> bool:
        slots = self._open()
        return slots is not None and slots.still_valid(info)

    def begin_write(self, version: int, length: int) -> tuple[ShardSlots, memoryview]:
        """Writable memory for a version fetched from elsewhere; the file is created if new,
        with the trainer's headroom (``default_capacity``) so its next snapshots fit too.

        Raises SlotBusy while the trainer holds the writer lock (it must be stopped first).
        """
        slots = self._open()
        if slots is None:
            slots = ShardSlots(self.path, default_capacity(length), rank=self.rank)
            self._slots = slots
            self._inode = os.stat(self.path).st_ino
        if length > slots.capacity:
            slots.close()
            self._slots = None
            raise LocalShardError(
                f"{self.path} holds {slots.capacity} bytes per slot, version {version} needs "
                f"{length}; remove the file so it is made again with the new size"
            )
        return slots, slots.begin(version, length)

    def close(self) -> None:
        if self._slots is not None:
            # A view may still be referenced (by a traceback, say): then GC unmaps it later.
            with contextlib.suppress(BufferError):
                self._slots.close()
            self._slots = None
