"""The server side of signed control requests (gemini.control.signing): each nonce once within
the time window, and who may make which call (auth.admitted uses it)."""

from __future__ import annotations

import hmac
import threading
import time
from collections.abc import Callable

from gemini.control.signing import (
    MAX_NONCES,
    WINDOW_SECONDS,
    Caller,
    PublicKey,
    Signed,
    canonical,
    is_loopback,
    parse_header,
    signer_caller,
)


class NonceLog:
    """The nonces seen in the last two time windows: a replay within them is refused. Bounded:
    past `max_nonces` live ones, every new request is refused. Thread-safe."""

    def __init__(self, window_s: float = WINDOW_SECONDS, max_nonces: int = MAX_NONCES) -> None:
        self.window_s, self._max = window_s, max_nonces
        self._seen: dict[str, float] = {}  # nonce -> when it may be forgotten
        self._pruned = 0.0
        self._lock = threading.Lock()

    def first_use(self, nonce: str, now: float) -> bool:
        with self._lock:
            if len(self._seen) >= self._max or now - self._pruned > self.window_s:
                self._seen = {n: t for n, t in self._seen.items() if t > now}
                self._pruned = now
                if len(self._seen) >= self._max:
                    return False
            if nonce in self._seen:
                return False
            self._seen[nonce] = now + 2 * self.window_s
            return True


class RequestVerifier:
    """One server's check of signed requests: the job token's HMAC, and the operator's
    signature when the pod has its public key; each nonce once (`nonces`, which servers of
    several jobs may share)."""

    def __init__(self, job_token: bytes, operator_key: PublicKey | None,
                 nonces: NonceLog | None = None, clock: Callable[[], float] = time.time,
                 ) -> None:
        self._job_token, self._operator_key = job_token, operator_key
        self._nonces = NonceLog() if nonces is None else nonces
        self._clock = clock

    @property
    def job_token(self) -> bytes:
        return self._job_token

    @property
    def knows_operator(self) -> bool:
        return self._operator_key is not None

    def check(self, header: bytes, method: str, target: str, audience_: str) -> Signed | None:
        """Who signed this request for this server (None: nobody it trusts, a stale or replayed
        request, or a signature for another address)."""
        parsed = parse_header(header)
        if parsed is None:
            return None
        scheme, stamp, nonce, digest, signature = parsed
        now = self._clock()
        if abs(now - int(stamp)) > self._nonces.window_s:
            return None
        data = canonical(scheme, method, target, audience_, stamp, nonce, digest)
        caller = signer_caller(scheme, data, signature, self._job_token, self._operator_key)
        if caller is None or not self._nonces.first_use(nonce, now):
            return None
        return Signed(caller, digest)


def admitted(verifier: RequestVerifier, header: bytes, method: str, target: str,
             audience: str, peer_host: str, job_token_allowed: bool) -> Signed | None:
    """The checked signature of a call this pod may take (None: refuse it with 401).
    `target`: the path with its query; `audience`: the address the request arrived on;
    `peer_host`: where it came from."""
    signed = verifier.check(header, method, target, audience)
    token = verifier.job_token
    bearer = token and header.startswith(b"Bearer ") and is_loopback(peer_host)
    if signed is None and bearer and hmac.compare_digest(header, b"Bearer " + token):
        signed = Signed(Caller.JOB, None)
    if signed is None:
        return None
    if signed.caller is Caller.OPERATOR or job_token_allowed or not verifier.knows_operator:
        return signed
    return None
