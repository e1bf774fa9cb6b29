"""Signed control requests (issue 45, item 3): who may make which call, and a recorded request
of no use at another address, later, again, or with another body."""

from __future__ import annotations

import pytest

from gemini.control import signing
from gemini.control.signing import Caller, Signer
from gemini.control.verifier import NonceLog, RequestVerifier, admitted

JOB, CONTROL = b"job-token-0123456789abcdef0123456789", "control-token-0123456789abcdef"
HERE = "10.0.0.7:7071"
NOW = 1_800_000_000.0


def verifier(operator: bool = True, now: float = NOW) -> RequestVerifier:
    key = signing.public_key_setting(
        {signing.CONTROL_PUBLIC_KEY_ENV: signing.control_public_key(CONTROL)})
    return RequestVerifier(JOB, key if operator else None, clock=lambda: now)


def header(signer: Signer, method: str = "POST", target: str = "/restore",
           audience: str = HERE, body: bytes = b"{}", now: float = NOW) -> bytes:
    return signer.header(method, target, audience, body, now).encode()


def test_the_operator_signs_any_call_and_the_job_token_only_its_own() -> None:
    check, op, job = verifier(), Signer.operator(CONTROL), Signer.job(JOB)

    def may(h: bytes, allowed: bool, v: RequestVerifier = check, peer: str = "10.0.0.9",
            ) -> bool:
        return admitted(v, h, "POST", "/restore", HERE, peer, allowed) is not None

    assert may(header(op), False) and may(header(op), True)
    assert may(header(job), True) and not may(header(job), False)
    # a pod without the operator's key: the job token does all, the operator's scheme nothing
    bare = verifier(operator=False)
    assert may(header(job), False, bare) and not may(header(op), False, bare)
    # a bearer job token: from loopback only (a trainer library older than signatures)
    bearer = b"Bearer " + JOB
    assert may(bearer, True, peer="127.0.0.1") and not may(bearer, True, peer="10.0.0.9")
    assert not may(bearer, False, peer="127.0.0.1")
    assert not may(b"Bearer " + CONTROL.encode(), False, peer="127.0.0.1")
    # a job token's HMAC sent under the operator's scheme is nobody's
    forged = header(job).replace(b"Gemini-Job", b"Gemini-Operator")
    assert not may(forged, False)


def test_a_recorded_request_is_refused_elsewhere_later_again_or_with_another_body() -> None:
    op = Signer.operator(CONTROL)
    sent = header(op, body=b'{"version": 3}')
    assert verifier().check(sent, "POST", "/restore", "10.0.0.8:7071") is None  # another pod
    assert verifier().check(sent, "POST", "/persist", HERE) is None  # another path
    assert verifier().check(sent, "GET", "/restore", HERE) is None  # another method
    assert verifier(now=NOW + 61).check(sent, "POST", "/restore", HERE) is None  # later
    once = verifier()
    signed = once.check(sent, "POST", "/restore", HERE)
    assert signed is not None and signed.caller is Caller.OPERATOR
    assert signed.body_matches(b'{"version": 3}') and not signed.body_matches(b'{"version": 4}')
    assert once.check(sent, "POST", "/restore", HERE) is None  # again
    # another operator key (another job's) is not this job's operator
    other = header(Signer.operator("another-jobs-control-token-0123456789"))
    assert verifier().check(other, "POST", "/restore", HERE) is None


@pytest.mark.parametrize("garbage", [b"", b"Gemini-Job", b"Gemini-Job a.b.c", b"\xff\xfe",
                                     b"Gemini-Job 1.2.3.4", b"Gemini-Operator x.y.z.w"])
def test_garbage_headers_are_nobody(garbage: bytes) -> None:
    assert verifier().check(garbage, "GET", "/inventory", HERE) is None


def test_the_nonce_log_is_bounded_and_forgets_after_two_windows() -> None:
    log = NonceLog(window_s=10, max_nonces=3)
    assert all(log.first_use(n, 0) for n in "abc")
    assert not log.first_use("a", 1) and not log.first_use("d", 1)  # full: refused, not grown
    assert log.first_use("d", 21) and log.first_use("a", 21)  # the old ones expired


def test_addresses_have_one_form_on_both_ends() -> None:
    assert signing.audience("::ffff:10.0.0.7", 7071) == HERE
    assert signing.audience("[fd00::1]", 80) == "[fd00::1]:80"
    assert signing.audience_of(("fd00:0::1", 80, 0, 0)) == "[fd00::1]:80"
    assert signing.is_loopback("127.0.0.3") and signing.is_loopback("::1")
    assert not signing.is_loopback("10.0.0.1") and not signing.is_loopback("localhost")


def test_a_bad_public_key_setting_says_what_it_must_be() -> None:
    with pytest.raises(ValueError, match="Ed25519 public key"):
        signing.public_key_setting({signing.CONTROL_PUBLIC_KEY_ENV: "abc"})
    assert signing.public_key_setting({}) is None
