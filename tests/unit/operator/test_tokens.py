"""Job tokens derived from the operator's key: no Secret is read (tokens.py)."""

from __future__ import annotations

from typing import Any

import pytest

from gemini.control.auth import Credentials
from gemini_operator.calls.tokens import JobTokens, TokenKeyError, load_key
from gemini_operator.core.render import JobRef
from tests.unit.operator.fake_kube import FakeKube

KEY = b"k" * 40


class NoSecretReads:
    """A KubeClient stand-in for one narrow check: it fails the test if a Secret is read."""

    def secret_value(self, *args: Any) -> str | None:
        raise AssertionError(f"a Secret was read: {args}")


def test_a_derived_token_is_stable_per_job_and_differs_for_a_recreated_job() -> None:
    tokens = JobTokens(NoSecretReads(), KEY)  # type: ignore[arg-type]
    job = JobRef("j", "ns", "uid-1")
    token, control = tokens.new(job)
    assert tokens.derived and tokens.of(job) == Credentials(control)
    assert len(token) == len(control) == 43 and token != control
    others = [JobRef("j", "ns", "uid-2"), JobRef("j", "other", "uid-1"), JobRef("k", "ns", "uid-1")]
    assert len({tokens.of(job), *(tokens.of(o) for o in others)}) == 4
    assert JobTokens(NoSecretReads(), b"x" * 40).of(job) != tokens.of(job)  # type: ignore[arg-type]


def test_without_a_key_tokens_are_random_and_read_back() -> None:
    kube = FakeKube(secrets={("ns", "j-peer-auth"): {"token": "random-token"}})
    tokens = JobTokens(kube, None)  # type: ignore[arg-type]
    job = JobRef("j", "ns", "u")
    assert not tokens.derived
    assert tokens.new(job) != tokens.new(job)
    # a job whose pods predate control tokens: the job token alone
    assert tokens.of(job) == Credentials("random-token")
    assert tokens.keep_control(job, "control-1") == "control-1"
    assert tokens.keep_control(job, "control-2") == "control-1"  # the one kept wins
    assert tokens.of(job) == Credentials("control-1")  # and never the job token after a 401


def test_a_short_key_is_refused_and_an_absent_one_means_random_tokens(tmp_path: Any) -> None:
    assert load_key({}) is None
    assert load_key({"GEMINI_OPERATOR_TOKEN_KEY": " " + "a" * 32 + "\n"}) == b"a" * 32
    path = tmp_path / "key"
    path.write_bytes(b"b" * 48 + b"\n")
    assert load_key({}, str(path)) == b"b" * 48
    with pytest.raises(TokenKeyError, match="at least 32 random"):
        load_key({"GEMINI_OPERATOR_TOKEN_KEY": "short"})
