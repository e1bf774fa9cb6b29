"""The two-slot protocol of one rank's slot file: one writer, readers that take no lock.

Writer rule: ``begin`` picks the slot that does NOT hold the newest complete version (newest =
highest sequence number, not highest step: after a rollback the steps go down again), marks it
"writing" with the next sequence number, and hands out a writable view of its payload; the
caller fills it; ``commit`` writes the header with state "complete" and the checksum. The
header is written last and carries its own CRC, so a torn or half-written slot never reads as
complete, and the newest complete version survives until the next one is complete. One writer
at a time (an exclusive ``flock`` held from ``begin`` to ``commit``/``abort``); readers take
no lock and use the sequence number to notice that a slot changed under them (``still_valid``).

Overwrite rule (``may_overwrite``): the slot ``begin`` would reuse may be overwritten only
when nothing recoverable lives there: it is not complete, or the newest complete version is
acknowledged by every holder (so the newest is the recoverable one) and the free slot is not
pinned. Trainers decide together (gemini_trainer.checkpointer) so that all skip or all write.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import numpy as np

from gemini.slots.layout import (
    SlotError,
    SlotFile,
    SlotInfo,
    SlotState,
    payload_checksum,
)
from gemini.slots.words import SharedWords


class ShardSlots(SlotFile, SharedWords):
    """The two version slots of one rank's shard (see the module docstring), on its mapped
    file (SlotFile) with the words its processes share (SharedWords)."""

    _pending: tuple[int, int, int, int] | None = None  # slot, version, seq, nbytes

    # -- reading ---------------------------------------------------------------------------

    def slot_info(self) -> tuple[SlotInfo, SlotInfo]:
        """Both slots' headers as they are now."""
        return self._info(0), self._info(1)

    def latest_complete(self) -> SlotInfo | None:
        """The most recently committed complete version (highest sequence number), or None."""
        done = [i for i in self.slot_info() if i.complete]
        return max(done, key=lambda i: i.seq) if done else None

    def find(self, version: int) -> SlotInfo | None:
        """The newest complete slot holding ``version``, or None."""
        done = [i for i in self.slot_info() if i.complete and i.version == version]
        return max(done, key=lambda i: i.seq) if done else None

    def read(self, version: int, *, verify: bool = False) -> memoryview:
        """A zero-copy read-only view of a complete version's payload.

        The view stays valid only until the writer reuses the slot (two commits later); a
        reader that copies it out should call ``still_valid`` afterwards. ``verify=True``
        recomputes the checksum first and raises SlotError on a mismatch.
        """
        info = self.find(version)
        if info is None:
            held = [(i.version, i.state.name) for i in self.slot_info()]
            raise SlotError(f"version {version} is not complete in {self.path} (slots: {held})")
        start = self._payload_offset(info.index)
        view = memoryview(self._mm)[start : start + info.payload_len].toreadonly()
        if verify and payload_checksum(view) != info.checksum:
            raise SlotError(
                f"version {version} in {self.path} fails its CRC-32 check: the payload is "
                "corrupt; fetch it again from a peer or from S3"
            )
        return view

    def verify(self, version: int) -> bool:
        """True iff ``version`` is complete and its payload matches its checksum."""
        try:
            self.read(version, verify=True)
        except SlotError:
            return False
        return True

    def still_valid(self, info: SlotInfo) -> bool:
        """True iff the slot still holds what ``info`` described (nobody reused it since)."""
        now = self._info(info.index)
        return now.complete and now.seq == info.seq and now.version == info.version

    def may_overwrite(self, acknowledged_seq: int | None = None) -> bool:
        """Whether the slot the next ``begin`` picks holds nothing recoverable (see the module
        docstring). ``acknowledged_seq`` overrides the sidecar's word (after a restore, the
        restored version is on every holder by construction)."""
        slots = self.slot_info()  # one read of both headers: this runs every step
        done = [i for i in slots if i.complete]
        if len(done) < 2:
            return True  # the slot `begin` picks holds nothing complete
        newest, free = sorted(done, key=lambda i: i.seq, reverse=True)
        acked = self.acknowledged_seq if acknowledged_seq is None else acknowledged_seq
        return acked >= newest.seq and free.seq != self.pinned_seq

    # -- writing ---------------------------------------------------------------------------

    def target_slot(self) -> int:
        """The slot the next ``begin`` will write: never the one with the newest complete."""
        newest = self.latest_complete()
        if newest is not None:
            return 1 - newest.index
        infos = self.slot_info()
        return min(infos, key=lambda i: (i.seq, i.index)).index

    def begin(self, version: int, nbytes: int) -> memoryview:
        """Start writing ``version``: returns a writable view of ``nbytes`` in the free slot."""
        if nbytes > self.capacity:
            raise SlotError(
                f"version {version} needs {nbytes} bytes but a slot of {self.path} holds "
                f"{self.capacity}; create the slots with a larger capacity"
            )
        self._writer.acquire()
        slot = self.target_slot()
        seq = max(i.seq for i in self.slot_info()) + 1
        self._write_header(slot, SlotState.WRITING, version, nbytes, seq, 0, 0)
        self._pending = (slot, version, seq, nbytes)
        start = self._payload_offset(slot)
        return memoryview(self._mm)[start : start + nbytes]

    def writing_array(self, version: int) -> tuple[SlotInfo, np.ndarray]:
        """The slot another process is writing ``version`` into, as a uint8 numpy view (a
        second training process of the node fills its region of it; see node_shard)."""
        writing = [i for i in self.slot_info()
                   if i.state == SlotState.WRITING and i.version == version]
        if not writing:
            raise SlotError(f"version {version} is not being written to {self.path}")
        info = max(writing, key=lambda i: i.seq)
        start = self._payload_offset(info.index)
        return info, self._bytes[start : start + info.payload_len]

    def pending_array(self) -> np.ndarray:
        """The slot being written, as a uint8 numpy view (for ``write_payload``)."""
        if self._pending is None:
            raise SlotError("no version is being written; call begin() first")
        slot, _, _, nbytes = self._pending
        start = self._payload_offset(slot)
        return self._bytes[start : start + nbytes]

    def commit(
        self, version: int, checksum: int | None = None, *, verify: bool = False
    ) -> SlotInfo:
        """Mark the version being written complete. ``checksum=None`` computes it here;
        ``verify=True`` recomputes it and refuses (SlotError, slot left incomplete) on a
        mismatch, for payloads received from elsewhere."""
        if self._pending is None or self._pending[1] != version:
            raise SlotError(f"commit({version}) without a matching begin({version})")
        slot, _, seq, nbytes = self._pending
        start = self._payload_offset(slot)
        if checksum is None or verify:
            actual = payload_checksum(self._bytes[start : start + nbytes])
            if checksum is not None and actual != checksum:
                self.abort()
                raise SlotError(
                    f"version {version} received for {self.path} has CRC-32 {actual:#010x}, "
                    f"expected {checksum:#010x}: refused, the previous version is kept"
                )
            checksum = actual
        self._write_header(slot, SlotState.COMPLETE, version, nbytes, seq, checksum, time.time_ns())
        self._pending = None
        self._writer.release()
        return self._info(slot)

    def drop_newer_than(self, version: int) -> list[int]:
        """Empty the slots that hold a version newer than ``version`` (after restoring it,
        they belong to the abandoned run: kept, the next write would overwrite ``version``
        instead, and a recovery could mix them with other ranks' new ones). Returns them."""
        if self._pending is not None:
            raise SlotError(f"version {self._pending[1]} is being written to {self.path}")
        self._writer.acquire()
        try:
            newer = [i for i in self.slot_info()
                     if i.version > version and i.state != SlotState.EMPTY]
            for info in newer:
                self._write_header(info.index, SlotState.EMPTY, info.version, 0, info.seq, 0, 0)
        finally:
            self._writer.release()
        return [i.version for i in newer]

    def abort(self) -> None:
        """Give up the version being written; its slot reads as empty."""
        if self._pending is not None:
            slot, version, seq, _ = self._pending
            self._write_header(slot, SlotState.EMPTY, version, 0, seq, 0, 0)
            self._pending = None
        self._writer.release()

    def put(self, version: int, chunks: Iterable[Any], checksum: int | None = None) -> SlotInfo:
        """Write a whole version received from elsewhere (a peer, S3) into the free slot.

        ``chunks`` are bytes-like pieces in order; their total length is the payload length,
        so pass a list (it is walked twice). With ``checksum`` given, a mismatch is refused.
        """
        pieces = list(chunks)
        total = sum(memoryview(p).nbytes for p in pieces)
        view = self.begin(version, total)
        try:
            pos = 0
            for piece in pieces:
                mv = memoryview(piece).cast("B")
                view[pos : pos + mv.nbytes] = mv
                pos += mv.nbytes
        except BaseException:
            view.release()
            self.abort()
            raise
        view.release()
        return self.commit(version, checksum, verify=checksum is not None)
