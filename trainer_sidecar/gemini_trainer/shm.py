"""Two version slots for one rank's shard in a tmpfs file, shared by trainer and sidecar.

No torch here (numpy, mmap, struct, zlib only) so the sidecar can map the same file.

File layout (little-endian; the file lives in GEMINI_SHM_DIR, a tmpfs such as /dev/shm or an
emptyDir with ``medium: Memory``)::

    offset 0                      file header, 4096 bytes (FILE_HEADER below)
    offset 4096                   slot 0 header, 64 bytes, padded to 4096
    offset 8192                   slot 0 payload, ``capacity`` bytes (rounded up to 4096)
    offset 8192 + stride          slot 1 header, then slot 1 payload, same sizes

    FILE_HEADER  "<8sIIiIQQ"  magic b"GEMSLOTS", format version, slot count (2), rank,
                              reserved, capacity (payload bytes per slot), slot stride
    offset 2048  int64        acknowledged: the sequence number of the newest own version
                              that every holder has (written by the sidecar; 0: none)
    offset 2056  int64        pinned: the sequence number of a version a long read (an S3
                              upload) needs kept (written by the sidecar; 0: none)
    offset 2064  int64        begin key: with several training processes per node, the key of
                              the snapshot local rank 0 has begun (gemini_trainer.node_shard)
    offset 2072  64 x (int64, int64)  per local rank: the key of the snapshot whose region it
                              has written, and that region's CRC-32
    SLOT_HEADER  "<8sIIiIqQQIIQ" (64 bytes): magic b"GEMSLOT1", format version, state
                              (0 empty, 1 writing, 2 complete), rank, checksum algorithm
                              (1 = CRC-32), version (the training step), payload length,
                              sequence number, payload checksum, header CRC-32 (over the
                              first 52 bytes), commit time (unix ns)

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

Checksum: CRC-32 (zlib's polynomial and values) of the payload, computed with ISA-L
(``isal.isal_zlib.crc32``: about 14.6 GiB/s here against 4.2 GiB/s for ``zlib.crc32``, the
same result). It releases the GIL on large buffers so it runs beside training, and detects
every burst error up to 32 bits. It guards against corruption, not against an attacker (peer
traffic is authenticated separately).

Payload layout (``write_payload``/``read_payload``): the raw bytes of each array first, each at
a 64-byte-aligned offset that stays the same from one step to the next, then a JSON index::

    PAYLOAD_PREFIX "<4sIQQ"  magic b"GIDX", reserved, index offset, index length  (24 bytes)
    data           array bytes at the offsets named in the index
    index          UTF-8 JSON {"tensors": [[name, dtype, shape, offset, nbytes], ...],
                               "meta": <small JSON tree>}
    padding        zeros, so that index + padding is a multiple of 64 KiB with at least
                   16 KiB to spare: the payload keeps its size from step to step

``dtype`` is a free string chosen by the writer (a numpy dtype string such as "<f4", or a name
such as "torch.bfloat16" that numpy cannot express); restore needs no unpickling.
"""

from __future__ import annotations

import errno
import fcntl
import json
import mmap
import os
import struct
import time
import zlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path
from typing import Any

import numpy as np
from isal import isal_zlib

FORMAT_VERSION = 1
SLOT_COUNT = 2
PAGE = 4096
ALIGN = 64
CHECKSUM_CRC32 = 1

FILE_MAGIC = b"GEMSLOTS"
SLOT_MAGIC = b"GEMSLOT1"
INDEX_MAGIC = b"GIDX"
FILE_HEADER = struct.Struct("<8sIIiIQQ")
SLOT_HEADER = struct.Struct("<8sIIiIqQQIIQ")
PAYLOAD_PREFIX = struct.Struct("<4sIQQ")
INDEX_SLACK = 16 << 10  # see index_region
INDEX_ALIGN = 64 << 10
_HEADER_CRC_SPAN = 52  # bytes of SLOT_HEADER covered by the header CRC (up to the checksum)
# Words in the file header page that the sidecar writes for the trainer (see the docstring):
# 8-byte aligned int64s, each stored and loaded whole, so no lock is needed.
_WORDS_OFFSET = 2048
_ACKNOWLEDGED, _PINNED, _BEGIN_KEY = 0, 1, 2
_REGION_WORDS = 3  # then (key, crc) per local rank
MAX_LOCAL_PROCESSES = 64

ENV_SHM_DIR = "GEMINI_SHM_DIR"
# Room a slot keeps beyond the payload it is first made for, so later versions fit when the
# user's extra state grows a little (the index is padded already, see index_region).
SLOT_HEADROOM_BYTES = 1 << 20


class SlotState(IntEnum):
    EMPTY = 0
    WRITING = 1
    COMPLETE = 2
    CORRUPT = 3  # never stored: a header that fails its own CRC or magic reads as this


class SlotError(Exception):
    """A slot file cannot be used as asked (wrong size, wrong format, busy, unknown version)."""


class SlotBusy(SlotError):
    """Another process holds the writer lock on this slot file."""


@dataclass(frozen=True)
class SlotInfo:
    index: int
    state: SlotState
    rank: int
    version: int
    payload_len: int
    seq: int
    checksum: int
    committed_unix_ns: int

    @property
    def complete(self) -> bool:
        return self.state is SlotState.COMPLETE


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def payload_checksum(data: Any, crc: int = 0) -> int:
    """CRC-32 of a bytes-like object, continued from `crc` (see the module docstring for why
    CRC-32). Releases the GIL. The sidecar verifies its data path with this same function."""
    return isal_zlib.crc32(data, crc) & 0xFFFFFFFF


def shard_path(rank: int, shm_dir: str | os.PathLike[str] | None = None, job: str = "") -> Path:
    """Where this rank's slot file lives: ``$GEMINI_SHM_DIR`` (default /dev/shm)."""
    base = Path(shm_dir or os.environ.get(ENV_SHM_DIR) or "/dev/shm")
    prefix = f"gemini-{job}-" if job else "gemini-"
    return base / f"{prefix}rank{rank}.slots"


def default_capacity(payload_len: int) -> int:
    """Slot capacity for a file first made for a payload of ``payload_len`` bytes: the
    payload plus SLOT_HEADROOM_BYTES (the trainer and the sidecar use the same rule)."""
    return payload_len + SLOT_HEADROOM_BYTES


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


class ShardSlots:
    """The two version slots of one rank's shard, memory-mapped from a tmpfs file.

    ``capacity_bytes`` is the largest payload a slot can hold; pass None to open an existing
    file with whatever capacity it was made with. Creating reserves the memory up front
    (``posix_fallocate``) so a full tmpfs fails here with ENOSPC instead of SIGBUS mid-copy.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        capacity_bytes: int | None = None,
        *,
        rank: int = 0,
    ) -> None:
        self.path = Path(path)
        self._fd = -1
        self._locked = False
        self._pending: tuple[int, int, int, int] | None = None  # slot, version, seq, nbytes
        self._fd = self._open_or_create(capacity_bytes, rank)
        size = os.fstat(self._fd).st_size
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        self._mm = mmap.mmap(self._fd, size, flags=flags)
        self._bytes = np.frombuffer(self._mm, dtype=np.uint8)
        self._words = np.frombuffer(self._mm, dtype="<i8", offset=_WORDS_OFFSET,
                                    count=_REGION_WORDS + 2 * MAX_LOCAL_PROCESSES)
        self.rank, self.capacity, self._stride = self._read_file_header()

    # -- opening ---------------------------------------------------------------------------

    def _open_or_create(self, capacity: int | None, rank: int) -> int:
        if capacity is None:
            if not self.path.exists():
                raise SlotError(f"{self.path} does not exist; give capacity_bytes to create it")
            return os.open(self.path, os.O_RDWR)
        stride = PAGE + _round_up(max(capacity, 1), PAGE)
        size = PAGE + SLOT_COUNT * stride
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            existing = os.fstat(fd).st_size
            if existing == 0:
                self._initialise(fd, size, capacity, rank, stride)
            elif existing != size:
                raise SlotError(
                    f"{self.path} was made for another capacity ({existing} bytes on disk, "
                    f"{size} expected for capacity {capacity}); remove it or open it with "
                    "capacity_bytes=None"
                )
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _initialise(self, fd: int, size: int, capacity: int, rank: int, stride: int) -> None:
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            if os.fstat(fd).st_size != 0:  # another process created it while we waited
                return
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as err:
                os.ftruncate(fd, 0)
                if err.errno == errno.ENOSPC:
                    raise SlotError(
                        f"not enough room in {self.path.parent} for {size} bytes of slots; "
                        "raise the memory-backed volume's sizeLimit or lower the capacity"
                    ) from err
                raise
            header = FILE_HEADER.pack(
                FILE_MAGIC, FORMAT_VERSION, SLOT_COUNT, rank, 0, capacity, stride
            )
            os.pwrite(fd, header, 0)
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)

    def _read_file_header(self) -> tuple[int, int, int]:
        magic, fmt, slots, rank, _, capacity, stride = FILE_HEADER.unpack_from(self._mm, 0)
        if magic != FILE_MAGIC or fmt != FORMAT_VERSION or slots != SLOT_COUNT:
            raise SlotError(
                f"{self.path} is not a GEMINI slot file of format {FORMAT_VERSION} "
                f"(magic {magic!r}, format {fmt}); remove it"
            )
        return int(rank), int(capacity), int(stride)

    def close(self) -> None:
        """Unmap and close. Views handed out earlier must be released first."""
        if self._fd < 0:
            return
        self._unlock()
        del self._bytes, self._words
        self._mm.close()
        os.close(self._fd)
        self._fd = -1

    def __enter__(self) -> ShardSlots:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- reading ---------------------------------------------------------------------------

    def _header_offset(self, slot: int) -> int:
        return PAGE + slot * self._stride

    def _payload_offset(self, slot: int) -> int:
        return self._header_offset(slot) + PAGE

    def _info(self, slot: int) -> SlotInfo:
        raw = bytes(self._mm[self._header_offset(slot) : self._header_offset(slot) + 64])
        fields = SLOT_HEADER.unpack(raw)
        magic, fmt, state, rank, _algo, version, length, seq, checksum, hcrc, when = fields
        if magic == b"\0" * 8:
            return SlotInfo(slot, SlotState.EMPTY, self.rank, -1, 0, 0, 0, 0)
        valid = (
            magic == SLOT_MAGIC
            and fmt == FORMAT_VERSION
            and hcrc == zlib.crc32(raw[:_HEADER_CRC_SPAN])
            and state in (SlotState.EMPTY, SlotState.WRITING, SlotState.COMPLETE)
            and length <= self.capacity
        )
        st = SlotState(state) if valid else SlotState.CORRUPT
        return SlotInfo(slot, st, rank, version, length, seq, checksum, when)

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

    # -- what the sidecar tells the trainer ------------------------------------------------

    @property
    def acknowledged_seq(self) -> int:
        return int(self._words[_ACKNOWLEDGED])

    @property
    def pinned_seq(self) -> int:
        return int(self._words[_PINNED])

    def acknowledge(self, seq: int) -> None:
        """Every holder has the own version committed with sequence number ``seq`` (and so
        every older one is no longer needed). Only ever moves forward."""
        if seq > self.acknowledged_seq:
            self._words[_ACKNOWLEDGED] = seq

    def pin(self, seq: int) -> None:
        """Keep the version with sequence number ``seq`` (0: keep nothing extra)."""
        self._words[_PINNED] = seq

    # -- what the training processes of one node tell each other (gemini_trainer.node_shard) -

    @property
    def begin_key(self) -> int:
        return int(self._words[_BEGIN_KEY])

    def publish_begin(self, key: int) -> None:
        self._words[_BEGIN_KEY] = key

    def region_done(self, local_rank: int) -> tuple[int, int]:
        """(key, CRC-32) that local rank ``local_rank`` published last."""
        at = _REGION_WORDS + 2 * local_rank
        return int(self._words[at]), int(self._words[at + 1])

    def publish_region(self, local_rank: int, key: int, crc: int) -> None:
        at = _REGION_WORDS + 2 * local_rank
        self._words[at + 1] = crc  # the CRC first: the key says the pair is complete
        self._words[at] = key

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

    def _lock(self) -> None:
        if self._locked:
            return
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as err:
            raise SlotBusy(
                f"another process is writing {self.path}; only one writer at a time "
                "(the trainer while it runs, the sidecar while it is stopped)"
            ) from err
        self._locked = True

    def _unlock(self) -> None:
        if self._locked:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            self._locked = False

    def _write_header(
        self,
        slot: int,
        state: SlotState,
        version: int,
        length: int,
        seq: int,
        checksum: int,
        when: int,
    ) -> None:
        head = SLOT_HEADER.pack(
            SLOT_MAGIC,
            FORMAT_VERSION,
            int(state),
            self.rank,
            CHECKSUM_CRC32,
            version,
            length,
            seq,
            checksum,
            0,
            when,
        )
        hcrc = zlib.crc32(head[:_HEADER_CRC_SPAN])
        head = head[:_HEADER_CRC_SPAN] + struct.pack("<I", hcrc) + head[_HEADER_CRC_SPAN + 4 :]
        off = self._header_offset(slot)
        self._mm[off : off + SLOT_HEADER.size] = head

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
        self._lock()
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
        self._unlock()
        return self._info(slot)

    def drop_newer_than(self, version: int) -> list[int]:
        """Empty the slots that hold a version newer than ``version`` (after restoring it,
        they belong to the abandoned run: kept, the next write would overwrite ``version``
        instead, and a recovery could mix them with other ranks' new ones). Returns them."""
        if self._pending is not None:
            raise SlotError(f"version {self._pending[1]} is being written to {self.path}")
        self._lock()
        try:
            newer = [i for i in self.slot_info()
                     if i.version > version and i.state != SlotState.EMPTY]
            for info in newer:
                self._write_header(info.index, SlotState.EMPTY, info.version, 0, info.seq, 0, 0)
        finally:
            self._unlock()
        return [i.version for i in newer]

    def abort(self) -> None:
        """Give up the version being written; its slot reads as empty."""
        if self._pending is not None:
            slot, version, seq, _ = self._pending
            self._write_header(slot, SlotState.EMPTY, version, 0, seq, 0, 0)
            self._pending = None
        self._unlock()

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


# -- payload: raw arrays + JSON index --------------------------------------------------------


def plan_layout(sizes: Sequence[int]) -> tuple[list[int], int]:
    """Offsets (64-byte aligned, after the prefix) for arrays of these byte sizes, and the end."""
    offsets: list[int] = []
    pos = _round_up(PAYLOAD_PREFIX.size, ALIGN)
    for size in sizes:
        offsets.append(pos)
        pos = _round_up(pos + size, ALIGN)
    return offsets, pos


def encode_index(entries: Sequence[TensorEntry], meta: Any) -> bytes:
    tensors = [[e.name, e.dtype, list(e.shape), e.offset, e.nbytes] for e in entries]
    return json.dumps({"tensors": tensors, "meta": meta}, separators=(",", ":")).encode()


def index_region(index_len: int) -> int:
    """Bytes reserved for an index: its length plus slack, rounded up to INDEX_ALIGN.

    The index's length changes a little from step to step (digits of the step, of the python
    RNG state), so the payload's size would too; the padding keeps it the same, so a slot file
    made for one version (by the sidecar, say, for a fetched copy) fits the next ones.
    """
    return _round_up(index_len + INDEX_SLACK, INDEX_ALIGN)


def payload_size(data_end: int, index: bytes) -> int:
    return data_end + index_region(len(index))


def write_index(buf: np.ndarray, data_end: int, index: bytes) -> int:
    """Write the JSON index after the data (zero-padded), the prefix in front; returns the
    payload size."""
    end = data_end + index_region(len(index))
    buf[data_end : data_end + len(index)] = np.frombuffer(index, dtype=np.uint8)
    buf[data_end + len(index) : end] = 0
    prefix = PAYLOAD_PREFIX.pack(INDEX_MAGIC, 0, data_end, len(index))
    buf[: PAYLOAD_PREFIX.size] = np.frombuffer(prefix, dtype=np.uint8)
    return end


def write_payload(buf: np.ndarray, arrays: Mapping[str, tuple[str, np.ndarray]], meta: Any) -> int:
    """Lay out ``arrays`` (name -> (dtype label, contiguous array)) and ``meta`` into ``buf``.

    Convenience for small payloads and tests; the trainer uses ``plan_layout`` and copies
    tensors itself. Returns the number of payload bytes written.
    """
    names = list(arrays)
    flat = [np.ascontiguousarray(arrays[n][1]).reshape(-1).view(np.uint8) for n in names]
    offsets, end = plan_layout([f.nbytes for f in flat])
    entries = []
    for name, data, off in zip(names, flat, offsets, strict=True):
        buf[off : off + data.nbytes] = data
        label, arr = arrays[name]
        entries.append(TensorEntry(name, label, tuple(arr.shape), off, data.nbytes))
    return write_index(buf, end, encode_index(entries, meta))


def encoded_size(arrays: Mapping[str, tuple[str, np.ndarray]], meta: Any) -> int:
    """Bytes ``write_payload`` will need for these arrays and meta."""
    sizes = [arrays[n][1].nbytes for n in arrays]
    offsets, end = plan_layout(sizes)
    entries = [
        TensorEntry(n, arrays[n][0], tuple(arrays[n][1].shape), o, s)
        for n, o, s in zip(arrays, offsets, sizes, strict=True)
    ]
    return payload_size(end, encode_index(entries, meta))


def read_payload(payload: Any) -> tuple[dict[str, TensorEntry], dict[str, np.ndarray], Any]:
    """Parse a payload: entries by name, zero-copy uint8 views of each array's bytes, meta."""
    data = np.frombuffer(payload, dtype=np.uint8)
    if data.nbytes < PAYLOAD_PREFIX.size:
        raise SlotError("payload too short to hold its index prefix")
    magic, _, index_off, index_len = PAYLOAD_PREFIX.unpack(data[: PAYLOAD_PREFIX.size].tobytes())
    if magic != INDEX_MAGIC or index_off + index_len > data.nbytes:
        raise SlotError("payload has no valid index (wrong magic or index past the end)")
    doc = json.loads(data[index_off : index_off + index_len].tobytes())
    entries: dict[str, TensorEntry] = {}
    views: dict[str, np.ndarray] = {}
    for name, dtype, shape, off, nbytes in doc["tensors"]:
        if off + nbytes > index_off:
            raise SlotError(f"array {name!r} runs past the data region of the payload")
        entries[name] = TensorEntry(name, dtype, tuple(shape), off, nbytes)
        views[name] = data[off : off + nbytes]
    return entries, views, doc["meta"]


def as_numpy(entry: TensorEntry, raw: np.ndarray) -> np.ndarray:
    """View raw bytes as the numpy array they were written from (numpy dtype labels only)."""
    return raw.view(np.dtype(entry.dtype)).reshape(entry.shape)
