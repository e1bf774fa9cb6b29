"""The payload codec: how one rank's tensors and state are laid out in a slot (gemini.slots).

The raw bytes of each array first, each at a 64-byte-aligned offset that stays the same from
one step to the next, then a JSON index::

    PAYLOAD_PREFIX "<4sIQQ"  magic b"GIDX", reserved, index offset, index length  (24 bytes)
    data           array bytes at the offsets named in the index
    index          UTF-8 JSON {"tensors": [[name, dtype, shape, offset, nbytes], ...],
                               "meta": <small JSON tree>}
    padding        zeros, so that index + padding is a multiple of 64 KiB with at least
                   16 KiB to spare: the payload keeps its size from step to step

``dtype`` is a free string chosen by the writer (a numpy dtype string such as "<f4", or a name
such as "torch.bfloat16" that numpy cannot express); restore needs no unpickling. No torch
here (numpy, json, struct only): the trainer's checkpointer turns tensors into these arrays.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from gemini.slots.layout import SlotError, round_up

ALIGN = 64
INDEX_MAGIC = b"GIDX"
PAYLOAD_PREFIX = struct.Struct("<4sIQQ")
INDEX_SLACK = 16 << 10  # see index_region
INDEX_ALIGN = 64 << 10


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def plan_layout(sizes: Sequence[int]) -> tuple[list[int], int]:
    """Offsets (64-byte aligned, after the prefix) for arrays of these byte sizes, and the end."""
    offsets: list[int] = []
    pos = round_up(PAYLOAD_PREFIX.size, ALIGN)
    for size in sizes:
        offsets.append(pos)
        pos = round_up(pos + size, ALIGN)
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
    return round_up(index_len + INDEX_SLACK, INDEX_ALIGN)


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
