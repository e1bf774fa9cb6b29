"""Payload checksums of the peer data path: CRC-32 everywhere.

Replication (PUT_CHUNK) verifies with CRC-32, the checksum the trainer already writes in its
slot header: the receiver takes the CRC-32 of each chunk as it lands, the chunk CRCs combine
(`crc32_combine`, no second pass over the bytes) into the CRC-32 of the whole shard, and that
must equal the trainer's. The sender never reads its payload for a checksum: one pass, on the
receiver, with the data still in cache. CRC-32 catches every error burst up to 32 bits, every
1-bit error and every 2-bit error less than 2^32-1 bits apart, where any additive sum misses a
bit set in one word and cleared at the same position in another.

Fetch replies (DATA) carry their chunk's CRC-32, so a corrupt chunk is found at once and
fetched again elsewhere; the fetcher combines the chunk CRCs into the whole payload's and
compares it with the source's slot CRC, again without a second pass. CRC-32 is not a MAC:
authenticity comes from the HMAC over each frame header (peer_frames.py).
"""

from __future__ import annotations

import functools

from gemini.slots.layout import payload_checksum

_CRC_POLY = 0xEDB88320  # CRC-32 (zlib, IEEE 802.3), reflected

# The trainer's slot checksum itself (zlib's values, ISA-L's speed), continued from `crc`:
# one function, so the two ends can never disagree on what they compute.
crc32 = payload_checksum


def _multmodp(a: int, b: int) -> int:
    """a * b modulo the CRC polynomial (bit-reflected, as in zlib's crc32.c)."""
    m, p = 1 << 31, 0
    while m:
        if a & m:
            p ^= b
        b = (b >> 1) ^ _CRC_POLY if b & 1 else b >> 1
        m >>= 1
    return p


def _square_table() -> tuple[int, ...]:
    powers, p = [], 1 << 30  # x^1
    for _ in range(64):  # x^(2^k) for k < 64: lengths up to 2^61 bytes
        powers.append(p)
        p = _multmodp(p, p)
    return tuple(powers)


_X2N = _square_table()


@functools.lru_cache(maxsize=256)  # chunk and piece lengths repeat: one multiply per combine
def _x8n(length: int) -> int:
    """x^(8 * length) modulo the polynomial: what appending `length` zero bytes multiplies by."""
    p, k, n = 1 << 31, 3, length  # 1 = x^0; bytes are 2^3 bits
    while n:
        if n & 1:
            p = _multmodp(_X2N[k], p)
        n >>= 1
        k += 1
    return p


def crc32_combine(crc1: int, crc2: int, length2: int) -> int:
    """CRC-32 of A + B from crc32(A), crc32(B) and len(B) (zlib's crc32_combine)."""
    return _multmodp(_x8n(length2), crc1) ^ crc2


def crc32_of_pieces(pieces: list[tuple[int, int]]) -> int:
    """CRC-32 of consecutive pieces given as (crc, length), in order."""
    crc = 0
    for piece_crc, length in pieces:
        crc = crc32_combine(crc, piece_crc, length)
    return crc
