"""Replica store: the shards of the peers this sidecar protects, two versions each, in memory.

Per held rank there are two slots: the newest complete version and the one being written. A
new version always goes into the slot that does not hold the newest complete one, so a
failure mid-transfer never costs the last good copy. Buffers are allocated once and reused
(the receive path writes straight into them); the memory budget bounds the total allocated,
and a version that would exceed it is refused while the complete one is kept. A version is
complete only when its chunks' CRC-32s (taken as they landed) combine into the CRC-32 of the
whole version that the trainer wrote; until then chunks found bad can be received again.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gemini_sidecar.checksum import crc32_of_pieces


class StoreError(Exception):
    """A replica operation that cannot be done as asked (unknown version, bad range)."""


class BudgetExceeded(StoreError):
    """Accepting a version would take the store past its memory budget."""


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

    def view(self) -> memoryview:
        return memoryview(self.buffer)[: self.length]


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
        return sum(len(s.buffer) for pair in self._slots.values() for s in pair)

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
        slot.complete, slot.seq, slot.received = False, self._seq, {}

    def _target(self, pair: tuple[_Slot, _Slot], version: int) -> _Slot:
        # A copy at or past this version is either this version's earlier, unfinished try or,
        # after the owner restarted from an older step, of the abandoned run: never the one to
        # keep. Overwrite the oldest such (an unfinished try first): no version is held twice.
        superseded = [s for s in pair if s.version >= version]
        if superseded:
            return min(superseded, key=lambda s: (s.version, s.complete))
        newest = self._newest_complete(pair)
        if newest is None:
            return min(pair, key=lambda s: s.seq)
        return pair[1] if newest is pair[0] else pair[0]

    @staticmethod
    def _newest_complete(pair: tuple[_Slot, _Slot]) -> _Slot | None:
        done = [s for s in pair if s.complete]
        return max(done, key=lambda s: s.seq) if done else None

    def _writing(self, rank: int, version: int) -> _Slot:
        for slot in self._slots.get(rank, ()):
            if slot.version == version and not slot.complete:
                return slot
        raise StoreError(f"rank {rank} version {version} is not being received here")

    def chunk_view(self, rank: int, version: int, offset: int, length: int) -> memoryview:
        """Writable memory for bytes [offset, offset+length) of a version being received."""
        slot = self._writing(rank, version)
        if offset < 0 or offset % 8 or offset + length > slot.length:
            raise StoreError(
                f"chunk [{offset}, {offset + length}) outside rank {rank} version {version} "
                f"of {slot.length} bytes (offsets must be multiples of 8)"
            )
        return memoryview(slot.buffer)[offset : offset + length]

    def chunk_done(self, rank: int, version: int, offset: int, length: int, crc: int) -> None:
        """Record a received chunk with the CRC-32 of the bytes that landed (a chunk received
        again at the same offset replaces the earlier one)."""
        self._writing(rank, version).received[offset] = (length, crc)

    def finish(self, rank: int, version: int, whole_crc: int) -> ReplicaInfo:
        """Mark complete if every byte arrived and the chunk CRCs combine into `whole_crc`
        (WholeChecksumMismatch if they do not: the version stays open for resent chunks)."""
        slot = self._writing(rank, version)
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
        return self._info(rank, slot)

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
