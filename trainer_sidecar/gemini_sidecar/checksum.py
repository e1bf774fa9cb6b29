"""Payload checksum for peer frames: a 64-bit word sum, fast enough for the data path.

CRC32 runs at about 4 GiB/s here, as fast as loopback TCP itself, so checksumming every chunk
with it would halve replication throughput. Summing little-endian 64-bit words with numpy runs
at tens of GiB/s on data still in cache. It detects any change of a single word, truncation
(the length is folded in) and, with the offset in the authenticated frame header, misplaced
chunks. It is additive: for chunks at offsets that are multiples of 8, the word sums of the
chunks add up to the word sum of the whole shard, so a receiver verifies a whole-shard checksum
for free. It is not a MAC; authenticity comes from the HMAC over each frame header.
"""

from __future__ import annotations

import numpy as np

_MASK = (1 << 64) - 1
_LENGTH_MIX = 0x9E3779B97F4A7C15


def word_sum(data: memoryview | bytes | bytearray) -> int:
    """Sum of the little-endian uint64 words of `data` (tail zero-padded), modulo 2**64."""
    view = memoryview(data).cast("B")
    whole = len(view) - len(view) % 8
    total = int(np.frombuffer(view[:whole], dtype="<u8").sum(dtype=np.uint64)) if whole else 0
    if whole < len(view):
        total += int.from_bytes(bytes(view[whole:]).ljust(8, b"\0"), "little")
    return total & _MASK


def finish(words: int, length: int) -> int:
    """Fold the length into a word sum, so that truncation or zero-padding is caught."""
    return (words + length * _LENGTH_MIX) & _MASK


def checksum(data: memoryview | bytes | bytearray) -> int:
    """The checksum of one buffer: finish(word_sum(data), len(data))."""
    return finish(word_sum(data), memoryview(data).nbytes)


def combine(word_sums: list[int]) -> int:
    """Word sum of a buffer from the word sums of its 8-byte-aligned consecutive pieces."""
    return sum(word_sums) & _MASK
