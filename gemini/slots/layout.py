"""The slot file's format and its mapping: two version slots for one rank's shard in a tmpfs file.

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

The words from offset 2048 are gemini.slots.words's; the rules that decide which slot is
written and when a slot reads as complete are gemini.slots.shard's.

Checksum: CRC-32 (zlib's polynomial and values) of the payload, computed with ISA-L
(``isal.isal_zlib.crc32``: about 14.6 GiB/s here against 4.2 GiB/s for ``zlib.crc32``, the
same result). It releases the GIL on large buffers so it runs beside training, and detects
every burst error up to 32 bits. It guards against corruption, not against an attacker (peer
traffic is authenticated separately).
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import struct
import zlib
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path
from typing import Any, Self

import numpy as np
from isal import isal_zlib

FORMAT_VERSION = 1
SLOT_COUNT = 2
PAGE = 4096
CHECKSUM_CRC32 = 1

FILE_MAGIC = b"GEMSLOTS"
SLOT_MAGIC = b"GEMSLOT1"
FILE_HEADER = struct.Struct("<8sIIiIQQ")
SLOT_HEADER = struct.Struct("<8sIIiIqQQIIQ")
_HEADER_CRC_SPAN = 52  # bytes of SLOT_HEADER covered by the header CRC (up to the checksum)
# The words in the file header page (see the docstring): 8-byte aligned int64s, each stored
# and loaded whole, so no lock is needed.
WORDS_OFFSET = 2048
ACKNOWLEDGED_WORD, PINNED_WORD, BEGIN_KEY_WORD = 0, 1, 2
REGION_WORDS = 3  # then (key, crc) per local rank
MAX_LOCAL_PROCESSES = 64
WORD_COUNT = REGION_WORDS + 2 * MAX_LOCAL_PROCESSES

ENV_SHM_DIR = "GEMINI_SHM_DIR"
# Room a slot keeps beyond the payload it is first made for, so later versions fit when the
# user's extra state grows a little (the payload's index is padded already).
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


def round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


class WriterLock:
    """The slot file's writer lock (``flock``), held from a ``begin`` to its end."""

    def __init__(self, fd: int, path: Path) -> None:
        self._fd, self._path = fd, path
        self.held = False

    def acquire(self) -> None:
        if self.held:
            return
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as err:
            raise SlotBusy(
                f"another process is writing {self._path}; only one writer at a time "
                "(the trainer while it runs, the sidecar while it is stopped)"
            ) from err
        self.held = True

    def release(self) -> None:
        if self.held:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            self.held = False


class SlotFile:
    """One slot file, memory-mapped: its headers, where each slot's payload lies, its writer lock.

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
        self._fd = self._open_or_create(capacity_bytes, rank)
        size = os.fstat(self._fd).st_size
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        self._mm = mmap.mmap(self._fd, size, flags=flags)
        self._bytes = np.frombuffer(self._mm, dtype=np.uint8)
        self._words = np.frombuffer(self._mm, dtype="<i8", offset=WORDS_OFFSET, count=WORD_COUNT)
        self.rank, self.capacity, self._stride = self._read_file_header()
        self._writer = WriterLock(self._fd, self.path)

    def _open_or_create(self, capacity: int | None, rank: int) -> int:
        if capacity is None:
            if not self.path.exists():
                raise SlotError(f"{self.path} does not exist; give capacity_bytes to create it")
            return os.open(self.path, os.O_RDWR)
        stride = PAGE + round_up(max(capacity, 1), PAGE)
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
        self._writer.release()
        del self._bytes, self._words
        self._mm.close()
        os.close(self._fd)
        self._fd = -1

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _header_offset(self, slot: int) -> int:
        return PAGE + slot * self._stride

    def _payload_offset(self, slot: int) -> int:
        return self._header_offset(slot) + PAGE

    def _info(self, slot: int) -> SlotInfo:
        """Slot ``slot``'s header as it is now (CORRUPT: it fails its CRC, magic or bounds)."""
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

    def _write_header(self, slot: int, state: SlotState, version: int, length: int, seq: int,
                      checksum: int, when: int) -> None:
        head = SLOT_HEADER.pack(SLOT_MAGIC, FORMAT_VERSION, int(state), self.rank,
                                CHECKSUM_CRC32, version, length, seq, checksum, 0, when)
        hcrc = zlib.crc32(head[:_HEADER_CRC_SPAN])
        head = head[:_HEADER_CRC_SPAN] + struct.pack("<I", hcrc) + head[_HEADER_CRC_SPAN + 4 :]
        off = self._header_offset(slot)
        self._mm[off : off + SLOT_HEADER.size] = head
