"""Who may call the control APIs: the job token and the operator's control token (as the
operator holds them, ``Credentials``; as a pod checks them, ``may_call``, by the control
token's SHA-256 in GEMINI_CONTROL_TOKEN_SHA256)."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping
from dataclasses import dataclass


def control_digest(token: str) -> str:
    """What a pod is given to check the operator's control token by: its SHA-256, in hex."""
    return hashlib.sha256(token.encode()).hexdigest()


CONTROL_DIGEST_ENV = "GEMINI_CONTROL_TOKEN_SHA256"


def control_digest_setting(env: Mapping[str, str]) -> str:
    """GEMINI_CONTROL_TOKEN_SHA256 (the sidecar's and the launcher's): empty, or 64 hex
    digits; ValueError saying so otherwise."""
    digest = env.get(CONTROL_DIGEST_ENV, "").strip().lower()
    if digest and (len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest)):
        raise ValueError(f"{CONTROL_DIGEST_ENV} must be 64 hex digits (the SHA-256 of the "
                         "operator's control token) or empty")
    return digest


def may_call(header: bytes, job_token: bytes, control_sha256: str, job_token_allowed: bool,
             ) -> bool:
    """Whether an `Authorization` header (raw bytes) may make a call.

    The operator's control token (its SHA-256 is `control_sha256`) may make any call. The job
    token, which every pod of the job holds, only those for which `job_token_allowed` (reads,
    and the trainer's own calls to its sidecar): so one pod cannot drive another's sidecar or
    launcher. Pods made before control tokens (`control_sha256` empty) take the job token
    for every call."""
    if control_sha256:
        token = header[len(b"Bearer "):] if header.startswith(b"Bearer ") else b""
        digest = hashlib.sha256(token).hexdigest().encode()
        if token and hmac.compare_digest(digest, control_sha256.encode()):
            return True
        if not job_token_allowed:
            return False
    return hmac.compare_digest(header, b"Bearer " + job_token)


@dataclass(frozen=True)
class Credentials:
    """The operator's bearer token for one job: its control token (the job token for a job
    made before control tokens). Never another token after a refusal: a pod that answers 401
    to the control token is not given the job token to try (it could be anyone's)."""

    token: str


Bearer = str | Credentials  # what a ControlClient is given to authenticate with
