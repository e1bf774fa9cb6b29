"""Replica store: the shards of the peers this sidecar protects, two versions each, in memory.

Per held rank there are two slots: the newest complete version and the one being written. A
new version never goes into the slot of the newest complete version older than it (what a
failed transfer falls back to), nor into the last complete slot while the other one is free:
a failure mid-transfer, or a begin that no data follows, never costs the last good copy. A
copy at or past the new version (an earlier try of it, or of a run its owner abandoned by
restarting from an older step) is the one overwritten when both slots are complete. Of two
incomplete slots, a new try of a version takes the slot of its earlier try, so two versions
received at once (a recovery's refill and a survivor's resend) do not wipe each other.
Buffers are allocated once and reused (the receive path writes straight into them); the
memory budget bounds the total allocated, and a version that would exceed it is refused while
the complete one is kept. The budget also covers the record kept per received chunk beyond
FREE_RECORDS per slot, so a peer sending many tiny chunks is refused instead of growing
memory outside the budget. A version is complete only when its chunks' CRC-32s (taken as
they landed) combine into the CRC-32 of the whole version that the trainer wrote; until then
chunks found bad can be received again.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gemini_sidecar.checksum import crc32_of_pieces


class StoreError(Exception):
    """A replica operation that cannot be done as asked (unknown version, bad range)."""


class BudgetExceeded(StoreError):
    """Accepting a version would take the store past its memory budget."""


# What one received chunk's record (offset, length, CRC-32 in a dict) costs, generously. The
# first FREE_RECORDS of a slot are free: real transfers need few (16 MiB chunks; interleaving
# splits some), so a budget sized to the buffers alone still fits them.
RECORD_BYTES = 256
FREE_RECORDS = 1024


class WholeChecksumMismatch(StoreError):
    """All bytes arrived but their CRC-32 is not the version's: some chunk must be resent."""


@dataclass
class _Slot:
    buffer: bytearray = field(default_factory=bytearray)
    version: int = -1
    length: int = 0
    source_checksum: int = 0
    complete: bool = False
    seq: int = 0  # order of begin() calls: the newest complete slot has the highest seq
    received: dict[int, tuple[int, int]] = field(default_factory=dict)  # offset -> (len, crc)
    rejected: set[int] = field(default_factory=set)  # offsets whose chunk failed its MAC

    def view(self) -> memoryview:
        return memoryview(self.buffer)[: self.length]

    @property
    def record_bytes(self) -> int:
        """Memory of the chunk records beyond the free ones (counted in the budget)."""
        return max(0, len(self.received) - FREE_RECORDS) * RECORD_BYTES

    def clear(self) -> None:
        self.version, self.length, self.complete, self.received = -1, 0, False, {}
        self.rejected = set()


@dataclass(frozen=True)
class ReplicaInfo:
    """What the inventory reports about one held version."""

    rank: int
    version: int
    complete: bool
    bytes: int
    received_bytes: int
    checksum: int


class ReplicaStore:
    """Two-version replica slots per held rank, within a memory budget (bytes allocated)."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self._slots: dict[int, tuple[_Slot, _Slot]] = {}
        self._seq = 0

    # -- accounting --------------------------------------------------------------------------
    @property
    def used_bytes(self) -> int:
        return sum(len(s.buffer) + s.record_bytes for pair in self._slots.values() for s in pair)

    def held_ranks(self) -> list[int]:
        return sorted(self._slots)

    def drop(self, rank: int) -> None:
        """Forget a rank (placement changed) and free its memory."""
        self._slots.pop(rank, None)

    # -- writing -----------------------------------------------------------------------------
    def begin(self, rank: int, version: int, length: int, source_checksum: int) -> None:
        """Prepare to receive `version` of `rank` (`length` bytes) into the free slot."""
        pair = self._slots.setdefault(rank, (_Slot(), _Slot()))
        slot = self._target(pair, version)
        grow = max(0, length - len(slot.buffer))
        if grow and self.used_bytes + grow > self.budget_bytes:
            raise BudgetExceeded(
                f"refusing version {version} of rank {rank}: {length} bytes would take the "
                f"replica store to {self.used_bytes + grow} bytes, over its budget of "
                f"{self.budget_bytes} (GEMINI_MEMORY_BUDGET_BYTES); the last complete "
                "version is kept"
            )
        if grow:
            slot.buffer = bytearray(length)  # fresh zeroed pages; old buffer freed
        self._seq += 1
        slot.version, slot.length, slot.source_checksum = version, length, source_checksum
        slot.complete, slot.seq, slot.received, slot.rejected = False, self._seq, {}, set()

    def _target(self, pair: tuple[_Slot, _Slot], version: int) -> _Slot:
        """The slot `version` goes into (see the module docstring for what is kept)."""
        fallback = self._newest_complete(pair, below=version)
        if fallback is not None:
            return pair[1] if fallback is pair[0] else pair[0]
        free = [s for s in pair if not s.complete]
        # An earlier try of this very version goes on in its slot; else a cleared slot, else
        # the oldest begun: never the other version being received while a free one is left
        # (a resend of an abandoned version must not wipe a refill under way).
        same = [s for s in free if s.version == version]
        if same:
            return same[0]
        if free:
            return min(free, key=lambda s: (s.version >= 0, s.seq))
        return min(pair, key=lambda s: (s.version, s.seq))  # both at or past it: the oldest

    @staticmethod
    def _newest_complete(pair: tuple[_Slot, _Slot], below: int) -> _Slot | None:
        done = [s for s in pair if s.complete and s.version < below]
        return max(done, key=lambda s: s.seq) if done else None

    def _writing(self, rank: int, version: int) -> _Slot:
        for slot in self._slots.get(rank, ()):
            if slot.version == version and not slot.complete:
                return slot
        raise StoreError(f"rank {rank} version {version} is not being received here")

    def chunk_view(self, rank: int, version: int, offset: int, length: int) -> memoryview:
        """Writable memory for bytes [offset, offset+length) of a version being received."""
        slot = self._writing(rank, version)
        if offset < 0 or offset % 8 or length <= 0 or offset + length > slot.length:
            raise StoreError(
                f"chunk [{offset}, {offset + length}) outside rank {rank} version {version} "
                f"of {slot.length} bytes (offsets must be multiples of 8, chunks not empty)"
            )
        if offset not in slot.received and len(slot.received) >= FREE_RECORDS:
            self._check_record_fits(rank, version)
        return memoryview(slot.buffer)[offset : offset + length]

    def _check_record_fits(self, rank: int, version: int) -> None:
        if self.used_bytes + RECORD_BYTES > self.budget_bytes:
            raise BudgetExceeded(
                f"refusing another chunk of rank {rank} version {version}: its record would "
                f"take the replica store past its budget of {self.budget_bytes} bytes "
                "(GEMINI_MEMORY_BUDGET_BYTES); send fewer, larger chunks"
            )

    def chunk_done(self, rank: int, version: int, offset: int, length: int, crc: int) -> None:
        """Record a received chunk with the CRC-32 of the bytes that landed (a chunk received
        again at the same offset replaces the earlier one)."""
        slot = self._writing(rank, version)
        slot.received[offset] = (length, crc)
        slot.rejected.discard(offset)

    def chunk_rejected(self, rank: int, version: int, offset: int) -> None:
        """Forget the chunk at `offset` (its bytes failed their MAC): the version cannot
        finish until it is received again."""
        slot = self._writing(rank, version)
        slot.received.pop(offset, None)
        slot.rejected.add(offset)

    def finish(self, rank: int, version: int, whole_crc: int) -> ReplicaInfo:
        """Mark complete if every byte arrived and the chunk CRCs combine into `whole_crc`
        (WholeChecksumMismatch if they do not: the version stays open for resent chunks)."""
        slot = self._writing(rank, version)
        if slot.rejected:
            raise WholeChecksumMismatch(
                f"rank {rank} version {version}: {len(slot.rejected)} chunks failed their keyed"
                f" MAC (first at offset {min(slot.rejected)})"
            )
        pos = 0
        pieces = []
        for offset in sorted(slot.received):
            if offset != pos:
                raise StoreError(f"rank {rank} version {version}: bytes missing at {pos}")
            length, crc = slot.received[offset]
            pieces.append((crc, length))
            pos += length
        if pos != slot.length:
            raise StoreError(f"rank {rank} version {version}: {pos} of {slot.length} bytes")
        actual = crc32_of_pieces(pieces)
        if actual != whole_crc:
            raise WholeChecksumMismatch(
                f"rank {rank} version {version}: the received bytes have CRC-32 {actual:#010x},"
                f" the version {whole_crc:#010x}"
            )
        slot.complete = True
        self._drop_superseded(rank, slot)
        return self._info(rank, slot)

    def _drop_superseded(self, rank: int, done: _Slot) -> None:
        """Now that `done` is complete, forget an earlier try of its version (kept until now
        as the last complete copy): no version is held twice."""
        for slot in self._slots.get(rank, ()):
            if slot is not done and slot.version == done.version:
                slot.clear()

    def abort(self, rank: int, version: int) -> None:
        """Give up a version in progress; the complete one stays."""
        for slot in self._slots.get(rank, ()):
            if slot.version == version and not slot.complete:
                slot.version, slot.received = -1, {}

    # -- reading -----------------------------------------------------------------------------
    def get(self, rank: int, version: int | None = None) -> tuple[ReplicaInfo, memoryview]:
        """A complete version (the newest when `version` is None) and a view of its bytes."""
        pair = self._slots.get(rank)
        if pair is None:
            raise StoreError(f"rank {rank} is not held here (held: {self.held_ranks()})")
        done = [s for s in pair if s.complete and (version is None or s.version == version)]
        if not done:
            raise StoreError(f"rank {rank} version {version} is not complete here")
        slot = max(done, key=lambda s: s.seq)
        return self._info(rank, slot), slot.view()

    def inventory(self) -> list[ReplicaInfo]:
        return [
            self._info(rank, slot)
            for rank in sorted(self._slots)
            for slot in sorted(self._slots[rank], key=lambda s: s.seq)
            if slot.version >= 0
        ]

    def _info(self, rank: int, slot: _Slot) -> ReplicaInfo:
        received = sum(length for length, _ in slot.received.values())
        return ReplicaInfo(
            rank, slot.version, slot.complete, slot.length, received, slot.source_checksum
        )
