"""How the training processes of one node write their shards: one slot file per node.

With one process per node (``SoleWriter``) the process's payload is the slot payload. With
numProcPerNode P > 1 (``RegionWriter``) the node's checkpoint is still one version in one slot
file, so the sidecar holds, replicates, serves, persists and restores it as it would a single
process's (placement stays per node, as in the paper). Its payload is a node index page, then
one region per local process::

    NODE_HEAD    "<4sII"   magic b"GNOD", region count P, reserved
    NODE_REGION  "<QQI4x"  P times: region offset, span (bytes), CRC-32 of the span
    region l     local rank l's payload (gemini_trainer.payload layout) at a page-aligned
                 offset; its span keeps REGION_SLACK spare so the user's state may grow a little

Writing one version (the P processes snapshot at the same steps: they decide together first):
local rank 0 begins the version (the writer lock; the slot marked "writing", so a reader of the
older version there sees its sequence number change) and publishes the snapshot's key in the
file header page; the others wait for that key before they touch the slot. Each copies its
region; its background thread checksums the span and publishes (key, CRC). Local rank 0's
background thread waits for all P, writes the node index, combines the CRCs (crc32_combine: no
second pass over the bytes) and commits. The key (a token local rank 0 draws once per launch,
shifted, plus the count of written snapshots) tells this attempt's words from a crashed one's.
"""

from __future__ import annotations

import secrets
import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from isal import isal_zlib

from gemini.slots.layout import MAX_LOCAL_PROCESSES, PAGE, SlotError, SlotInfo, payload_checksum
from gemini.slots.shard import ShardSlots

NODE_MAGIC = b"GNOD"
NODE_HEAD = struct.Struct("<4sII")
NODE_REGION = struct.Struct("<QQI4x")
REGION_SLACK = 64 << 10
WAIT_S = 120.0  # how long one local process waits for the others of the same snapshot
_POLL_S = 0.0005

# (payload bytes, whether to create the file) -> the node's slots, big enough
OpenSlots = Callable[[int, bool], ShardSlots]
# (this process's payload bytes, its token) -> every local rank's, in local rank order
GatherLocal = Callable[[int, int], Sequence[tuple[int, int]]]


def region_span(nbytes: int) -> int:
    return (nbytes + REGION_SLACK + PAGE - 1) // PAGE * PAGE


@dataclass(frozen=True)
class NodeLayout:
    """Where each local process's region lies in the node's payload."""

    spans: tuple[int, ...]

    def offset(self, local_rank: int) -> int:
        return PAGE + sum(self.spans[:local_rank])

    @property
    def total(self) -> int:
        return PAGE + sum(self.spans)

    def encode_index(self, crcs: Sequence[int]) -> bytes:
        regions = b"".join(NODE_REGION.pack(self.offset(i), span, crc)
                           for i, (span, crc) in enumerate(zip(self.spans, crcs, strict=True)))
        head = NODE_HEAD.pack(NODE_MAGIC, len(self.spans), 0) + regions
        return head + b"\0" * (PAGE - len(head))

    def checksum(self, index_crc: int, crcs: Sequence[int]) -> int:
        """The CRC-32 of the whole payload from the CRCs of its parts."""
        total = index_crc
        for span, crc in zip(self.spans, crcs, strict=True):
            total = isal_zlib.crc32_combine(total, crc, span)
        return total


def node_regions(payload: memoryview) -> list[tuple[int, int, int]]:
    """(offset, span, CRC-32) of every region named by a node payload's index page."""
    if len(payload) < PAGE:
        raise SlotError(f"a node payload of {len(payload)} bytes has no index page")
    magic, count, _ = NODE_HEAD.unpack_from(payload, 0)
    if magic != NODE_MAGIC or not 0 < count <= MAX_LOCAL_PROCESSES:
        raise SlotError(
            f"the payload is not a node checkpoint of several processes (magic {magic!r}, "
            f"count {count}): was it written with another numProcPerNode?"
        )
    regions = [NODE_REGION.unpack_from(payload, NODE_HEAD.size + i * NODE_REGION.size)
               for i in range(count)]
    for offset, span, _ in regions:
        if offset < PAGE or offset + span > len(payload):
            raise SlotError(f"a region at {offset} of {span} bytes lies outside the payload")
    return regions


def region_payload(payload: memoryview, local_rank: int, local_world: int) -> memoryview:
    """Local rank ``local_rank``'s region of a node payload, its CRC checked."""
    regions = node_regions(payload)
    if len(regions) != local_world:
        raise SlotError(
            f"the node checkpoint holds {len(regions)} processes' shards, this node runs "
            f"{local_world} (numProcPerNode cannot change)"
        )
    offset, span, crc = regions[local_rank]
    region = payload[offset : offset + span]
    if payload_checksum(region) != crc:
        raise SlotError(f"local rank {local_rank}'s region fails its CRC-32 check: corrupt")
    return region


class SoleWriter:
    """One process per node: its payload is the slot payload (the shm format as it is)."""

    def __init__(self, open_slots: OpenSlots) -> None:
        self._open_slots = open_slots
        self._slots: ShardSlots | None = None

    def begin(self, step: int, nbytes: int) -> np.ndarray:
        self._slots = self._open_slots(nbytes, True)
        self._slots.begin(step, nbytes).release()
        return self._slots.pending_array()

    def commit(self, step: int) -> SlotInfo | None:
        assert self._slots is not None
        return self._slots.commit(step)

    def abort(self) -> None:
        if self._slots is not None:
            self._slots.abort()


class RegionWriter:
    """One of P processes of a node: writes its region (see the module docstring)."""

    def __init__(self, open_slots: OpenSlots, gather: GatherLocal, local_rank: int,
                 local_world: int) -> None:
        if not 1 < local_world <= MAX_LOCAL_PROCESSES or not 0 <= local_rank < local_world:
            raise SlotError(f"local rank {local_rank} of {local_world}: at most "
                            f"{MAX_LOCAL_PROCESSES} processes per node")
        self._open_slots, self._gather = open_slots, gather
        self.local_rank, self.local_world = local_rank, local_world
        self.layout: NodeLayout | None = None
        self._slots: ShardSlots | None = None
        self._token = 0
        self._written = 0
        self._key = 0
        self._payload: np.ndarray | None = None

    def begin(self, step: int, nbytes: int) -> np.ndarray:
        """This process's region of the version being written (its full span)."""
        if self.layout is None:
            self._plan(nbytes)
        assert self.layout is not None and self._slots is not None
        span = self.layout.spans[self.local_rank]
        if nbytes > span:
            raise SlotError(
                f"local rank {self.local_rank}'s state grew to {nbytes} bytes, past its region "
                f"of {span} planned at the first snapshot; restart the training to plan again"
            )
        self._written += 1
        self._key = (self._token << 32) | self._written
        if self.local_rank == 0:
            self._slots.begin(step, self.layout.total).release()
            self._slots.publish_begin(self._key)
            payload = self._slots.pending_array()
        else:
            payload = self._await_begin(step)
        self._payload = payload
        offset = self.layout.offset(self.local_rank)
        return payload[offset : offset + span]

    def _plan(self, nbytes: int) -> None:
        token = secrets.randbits(31) if self.local_rank == 0 else 0
        everyone = list(self._gather(nbytes, token))
        if len(everyone) != self.local_world:
            raise SlotError(f"{len(everyone)} local processes answered, {self.local_world} run")
        self._token = everyone[0][1]
        self.layout = NodeLayout(tuple(region_span(n) for n, _ in everyone))
        total = self.layout.total
        if self.local_rank == 0:  # the only one to create it: no race between creators
            self._slots = self._open_slots(total, True)
            return
        _wait(lambda: self._opened(total), "local rank 0 to create the slot file")

    def _opened(self, total: int) -> bool:
        try:
            self._slots = self._open_slots(total, False)
        except (SlotError, ValueError, FileNotFoundError):
            return False  # not there yet, or being initialised (empty, no header yet)
        return True

    def _await_begin(self, step: int) -> np.ndarray:
        assert self._slots is not None
        _wait(lambda: self._slots is not None and self._slots.begin_key == self._key,
              f"local rank 0 to begin step {step}")
        return self._slots.writing_array(step)[1]

    def commit(self, step: int) -> SlotInfo | None:
        """Publish this region's CRC; local rank 0 then commits the node's version (others
        return None)."""
        assert self.layout is not None and self._slots is not None and self._payload is not None
        payload, self._payload = self._payload, None
        offset, span = self.layout.offset(self.local_rank), self.layout.spans[self.local_rank]
        crc = payload_checksum(payload[offset : offset + span])
        self._slots.publish_region(self.local_rank, self._key, crc)
        if self.local_rank != 0:
            return None
        crcs = self._await_regions(step)
        index = self.layout.encode_index(crcs)
        payload[:PAGE] = np.frombuffer(index, dtype=np.uint8)
        return self._slots.commit(step, self.layout.checksum(payload_checksum(index), crcs))

    def _await_regions(self, step: int) -> list[int]:
        slots, key = self._slots, self._key
        assert slots is not None
        _wait(lambda: all(slots.region_done(i)[0] == key for i in range(self.local_world)),
              f"every local process to write step {step}")
        return [slots.region_done(i)[1] & 0xFFFFFFFF for i in range(self.local_world)]

    def abort(self) -> None:
        self._payload = None
        if self.local_rank == 0 and self._slots is not None:
            self._slots.abort()


def _wait(done: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not done():
        if time.monotonic() > deadline:
            raise SlotError(f"waited {WAIT_S:.0f}s for {what}: has a process of this node died?")
        time.sleep(_POLL_S)
