"""Job tokens derived from the operator's key: no Secret is read (tokens.py)."""

from __future__ import annotations

from typing import Any

import pytest

from gemini_operator.render import JobRef
from gemini_operator.tokens import JobTokens, TokenKeyError, load_key

KEY = b"k" * 40


class NoSecretReads:
    """A KubeClient stand-in for one narrow check: it fails the test if a Secret is read."""

    def secret_value(self, *args: Any) -> str | None:
        raise AssertionError(f"a Secret was read: {args}")


class OneSecret:
    def secret_value(self, namespace: str, name: str, key: str) -> str | None:
        return "random-token" if (namespace, name, key) == ("ns", "j-peer-auth", "token") else None


def test_a_derived_token_is_stable_per_job_and_differs_for_a_recreated_job() -> None:
    tokens = JobTokens(NoSecretReads(), KEY)  # type: ignore[arg-type]
    job = JobRef("j", "ns", "uid-1")
    assert tokens.derived and tokens.new(job) == tokens.of(job)
    assert len(tokens.of(job) or "") == 43
    others = [JobRef("j", "ns", "uid-2"), JobRef("j", "other", "uid-1"), JobRef("k", "ns", "uid-1")]
    assert len({tokens.of(job), *(tokens.of(o) for o in others)}) == 4
    assert JobTokens(NoSecretReads(), b"x" * 40).of(job) != tokens.of(job)  # type: ignore[arg-type]


def test_without_a_key_tokens_are_random_and_read_back() -> None:
    tokens = JobTokens(OneSecret(), None)  # type: ignore[arg-type]
    assert not tokens.derived
    assert tokens.new(JobRef("j", "ns", "u")) != tokens.new(JobRef("j", "ns", "u"))
    assert tokens.of(JobRef("j", "ns", "u")) == "random-token"


def test_a_short_key_is_refused_and_an_absent_one_means_random_tokens(tmp_path: Any) -> None:
    assert load_key({}) is None
    assert load_key({"GEMINI_OPERATOR_TOKEN_KEY": " " + "a" * 32 + "\n"}) == b"a" * 32
    path = tmp_path / "key"
    path.write_bytes(b"b" * 48 + b"\n")
    assert load_key({}, str(path)) == b"b" * 48
    with pytest.raises(TokenKeyError, match="at least 32 random"):
        load_key({"GEMINI_OPERATOR_TOKEN_KEY": "short"})
