"""The peer wire format (see gemini_sidecar.protocol): the challenge, the fixed frame header
and its HMAC-SHA256, the frame types and flags, the sizes on the wire, and the errors a
connection raises. Standard library only.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import struct
from dataclasses import dataclass

MAGIC = b"GMN3"  # 3: payloads carry an AES-GMAC tag (2: Poly1305)
CHALLENGE_MAGIC = b"GMS3"
NONCE_BYTES = 16
MAX_JOB_NAME_BYTES = 253
FIELDS = struct.Struct(">4sBBHIQQQQQQ")  # the header's fields, before its MAC
_MAC_BYTES = 32
HEADER_BYTES = FIELDS.size + _MAC_BYTES
CHALLENGE_BYTES = len(CHALLENGE_MAGIC) + NONCE_BYTES
TAG_BYTES = 16  # the GMAC tag after every payload
PUBLIC_KEY_BYTES = 32  # X25519
CLIENT_TO_SERVER = 0  # the directions, in every MAC and one-time key
SERVER_TO_CLIENT = 1


def wire_payload_bytes(length: int) -> int:
    """Bytes that follow a header whose payload is `length` bytes long (payload and tag)."""
    return length + TAG_BYTES if length else 0


class FrameType(enum.IntEnum):
    HELLO = 1
    WELCOME = 2
    ERROR = 3
    PUT_BEGIN = 10  # checksum: the trainer's CRC-32 of the whole version
    PUT_CHUNK = 11  # payload: bytes [offset, offset+length); its CRC-32 comes back in the ACK
    PUT_END = 12  # checksum: the whole version's CRC-32 again
    ACK = 13
    GET_INFO = 20
    INFO = 21
    GET = 22
    DATA = 23  # checksum: the CRC-32 of the payload


FLAG_COMPLETE = 1  # INFO/ACK: the version is complete
FLAG_EXACT = 2  # GET_INFO: the version field names the version wanted (else: newest)
FLAG_CORRUPT = 4  # ERROR to PUT_END: the chunks do not add up to the CRC-32; resend bad ones
FLAG_ENCRYPT = 8  # HELLO/WELCOME: the payload has an X25519 key; payloads after are encrypted
PLAINTEXT_REFUSED = ("this sidecar takes only encrypted peer traffic: set GEMINI_PEER_ENCRYPTION=on"
                     " on every sidecar of the job (spec.checkpoint.peerEncryption)")


class ProtocolError(Exception):
    """A malformed, unexpected or oversized frame: the connection is dropped."""


class ReadTimeout(ProtocolError):
    """A frame or payload that started but did not finish within the read timeout."""


class AuthError(ProtocolError):
    """A frame that fails authentication (no token, another job's token, replay)."""


class PeerRefused(Exception):
    """The peer answered with an ERROR frame; the message says why."""


@dataclass(frozen=True)
class Frame:
    """One frame header. `length` is the payload length that follows on the wire."""

    type: FrameType
    rank: int = 0
    version: int = 0
    offset: int = 0
    length: int = 0
    checksum: int = 0
    total: int = 0
    flags: int = 0


def pack_fields(frame: Frame, seq: int) -> bytes:
    """The header's fields of `frame` sent as frame number `seq` (its MAC follows them)."""
    return FIELDS.pack(
        MAGIC, int(frame.type), frame.flags, 0, frame.rank, frame.version, frame.offset,
        frame.length, frame.checksum, frame.total, seq,
    )


def header_mac(token: bytes, nonces: bytes, direction: int, fields: bytes) -> bytes:
    """The HMAC-SHA256 that follows a header's fields: keyed with the job token, over both
    nonces (the connection), the direction and the fields (with the sequence number)."""
    return hmac.new(token, nonces + bytes([direction]) + fields, hashlib.sha256).digest()


def unpack_header(raw: bytes) -> tuple[Frame, int]:
    """The frame and sequence number in a header's fields (its MAC not checked here)."""
    magic, ftype, flags, _, rank, version, offset, length, csum, total, seq = FIELDS.unpack(
        raw[: FIELDS.size]
    )
    if magic != MAGIC:
        raise ProtocolError(f"bad frame magic {magic!r}")
    try:
        kind = FrameType(ftype)
    except ValueError as err:
        raise ProtocolError(f"unknown frame type {ftype}") from err
    return Frame(kind, rank, version, offset, length, csum, total, flags), seq


class ChecksumMismatch(ProtocolError):
    """A payload whose checksum differs from the one in its (authenticated) header."""

    def __init__(self, frame: Frame) -> None:
        super().__init__(
            f"checksum mismatch in {frame.type.name} rank {frame.rank} version {frame.version}"
            f" at offset {frame.offset} ({frame.length} bytes)"
        )
        self.frame = frame


class PayloadTampered(ChecksumMismatch):
    """A payload whose GMAC tag is wrong: changed on the path (whatever its CRC-32)."""

    def __init__(self, frame: Frame) -> None:
        super().__init__(frame)
        self.args = (f"payload of {frame.type.name} rank {frame.rank} version {frame.version}"
                     f" at offset {frame.offset} ({frame.length} bytes) failed its keyed MAC"
                     " (AES-GMAC): changed on the path",)
