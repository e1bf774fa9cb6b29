"""Signed control requests: no token crosses the network.

A request is signed instead of carrying a bearer token. The signature covers the method, the
path with its query, the SHA-256 of the body, the address the request was sent to (its
*audience*: the server compares it with the address the request arrived on), a timestamp and
a random nonce. A recorded request is then of no use elsewhere (another address), later
(outside the time window) or again (the nonce is remembered for the window's length).

Two signers:

- the operator's (``Gemini-Operator``): Ed25519, by a key derived from the job's control
  token. A pod holds only the public key (GEMINI_CONTROL_PUBLIC_KEY), so no pod can sign as
  the operator, not even the job's own trainer, whose code is the user's.
- the job's (``Gemini-Job``): HMAC-SHA256 by the job token, which every pod of the job holds:
  reads, the trainer's calls to its sidecar, one sidecar's reads of another's inventory, the
  launcher's failure hints to the operator.

The server checks the header before it reads the body (gemini.control.verifier), and the body
against the signed digest after (``Signed.body_matches``). This module is pure (no clock, no
state); the verifier keeps the nonces."""

from __future__ import annotations

import base64
import hashlib
import hmac
import ipaddress
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import Enum

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)

OPERATOR_SCHEME = "Gemini-Operator"
JOB_SCHEME = "Gemini-Job"
CONTROL_PUBLIC_KEY_ENV = "GEMINI_CONTROL_PUBLIC_KEY"
# The audience of a failure hint: the operator is reached through a Service, so the address
# the launcher dials is not the one the operator's socket sees.
HINTS_AUDIENCE = "gemini-operator-hints"
WINDOW_SECONDS = 60.0  # how far a request's timestamp may be from the server's clock
MAX_NONCES = 1 << 16  # remembered at once: a flood of valid requests is refused past it
_SEED_LABEL = b"gemini control ed25519 v1\n"
PublicKey = Ed25519PublicKey  # for the servers' settings, which import no cryptography


class Caller(Enum):
    """Who signed a request."""

    OPERATOR = "operator"
    JOB = "job"


def plain_ip(text: str) -> str:
    """`text` as an IP without brackets, zone or an IPv4-mapped IPv6 prefix ("::ffff:10.0.0.1");
    a name as it is."""
    text = text.strip("[]")
    try:
        ip = ipaddress.ip_address(text.split("%", 1)[0])
    except ValueError:
        return text
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return str(ip.ipv4_mapped)
    return str(ip)


def audience(host: str, port: int) -> str:
    """The canonical form of an address, the same on both ends: IPv4 as dotted quad (also when
    an IPv6 listener sees it mapped), IPv6 in brackets, a name in lower case."""
    ip = plain_ip(host)
    return f"[{ip}]:{port}" if ":" in ip else f"{ip.lower()}:{port}"


def audience_of(sockaddr: object) -> str:
    """The audience of a socket address (a listener's own, or the one a client dialed)."""
    if isinstance(sockaddr, tuple) and len(sockaddr) >= 2:
        return audience(str(sockaddr[0]), int(sockaddr[1]))
    return str(sockaddr)


def body_digest(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()


def canonical(scheme: str, method: str, target: str, audience_: str, stamp: str, nonce: str,
              digest: str) -> bytes:
    """The bytes a signature covers."""
    return "\n".join(("gemini-control-v1", scheme, method.upper(), target, audience_, stamp,
                      nonce, digest)).encode("utf-8", "surrogateescape")


def control_private_key(control_token: str) -> Ed25519PrivateKey:
    """The operator's signing key for one job, derived from its control token."""
    seed = hashlib.sha256(_SEED_LABEL + control_token.encode()).digest()
    return Ed25519PrivateKey.from_private_bytes(seed)


def control_public_key(control_token: str) -> str:
    """What the job's pods verify the operator by: the raw Ed25519 public key, base64."""
    raw = control_private_key(control_token).public_key().public_bytes(
        serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return base64.b64encode(raw).decode()


def public_key_setting(env: Mapping[str, str]) -> Ed25519PublicKey | None:
    """GEMINI_CONTROL_PUBLIC_KEY: empty (None), or a base64 Ed25519 public key; ValueError
    saying so otherwise."""
    text = env.get(CONTROL_PUBLIC_KEY_ENV, "").strip()
    if not text:
        return None
    try:
        return Ed25519PublicKey.from_public_bytes(base64.b64decode(text, validate=True))
    except ValueError as err:
        raise ValueError(f"{CONTROL_PUBLIC_KEY_ENV} must be the operator's Ed25519 public key "
                         f"(32 bytes, base64) or empty: {err}") from None


class Signer:
    """Signs requests as the operator (a control token) or as the job (a job token)."""

    def __init__(self, scheme: str, sign: Callable[[bytes], bytes]) -> None:
        self.scheme, self._sign = scheme, sign

    @classmethod
    def operator(cls, control_token: str) -> Signer:
        return cls(OPERATOR_SCHEME, control_private_key(control_token).sign)

    @classmethod
    def job(cls, job_token: str | bytes) -> Signer:
        key = job_token.encode() if isinstance(job_token, str) else job_token
        return cls(JOB_SCHEME, lambda data: hmac.digest(key, data, "sha256"))

    def header(self, method: str, target: str, audience_: str, body: bytes, now: float) -> str:
        """The Authorization header's value for one request sent at `now` (Unix seconds)."""
        stamp = str(int(now))
        nonce, digest = secrets.token_hex(16), body_digest(body)
        signature = self._sign(canonical(self.scheme, method, target, audience_, stamp, nonce,
                                         digest))
        sig = base64.urlsafe_b64encode(signature).decode().rstrip("=")
        return f"{self.scheme} {stamp}.{nonce}.{digest}.{sig}"


@dataclass(frozen=True)
class Signed:
    """A request's signature as it checked out: who signed it, and the body's digest it
    signed (``body_matches``)."""

    caller: Caller
    digest: str | None  # None: a bearer job token on loopback (nothing signed)

    def body_matches(self, body: bytes) -> bool:
        return self.digest is None or hmac.compare_digest(body_digest(body), self.digest)


def parse_header(header: bytes) -> tuple[str, str, str, str, bytes] | None:
    """(scheme, stamp, nonce, digest, signature) of an Authorization header that has the
    form of a signature (None: it has not)."""
    try:
        scheme, _, rest = header.decode("ascii").partition(" ")
        stamp, nonce, digest, sig = rest.split(".")
        signature = base64.urlsafe_b64decode(sig + "=" * (-len(sig) % 4))
        int(stamp)
    except ValueError:  # not ASCII, not four fields, not base64, not a number
        return None
    if len(nonce) != 32 or len(digest) != 64:
        return None
    return scheme, stamp, nonce, digest, signature


def signer_caller(scheme: str, data: bytes, signature: bytes, job_token: bytes,
                  operator_key: PublicKey | None) -> Caller | None:
    """Who made `signature` over `data`, if anyone this pod trusts."""
    if scheme == JOB_SCHEME and job_token:
        good = hmac.digest(job_token, data, "sha256")
        return Caller.JOB if hmac.compare_digest(good, signature) else None
    if scheme == OPERATOR_SCHEME and operator_key is not None:
        try:
            operator_key.verify(signature, data)
        except InvalidSignature:
            return None
        return Caller.OPERATOR
    return None


def is_loopback(host: str) -> bool:
    """Whether a peer's host is this machine (or, in a pod, this pod's network namespace)."""
    try:
        return ipaddress.ip_address(plain_ip(host)).is_loopback
    except ValueError:  # a name
        return False
