"""`gemini operator run --identity`: the Lease holder's name, from the flag or the environment
the Helm chart sets, reaches the operator's options."""

from __future__ import annotations

from typing import Any

import pytest

import gemini_operator.runtime.main
from gemini_cli import build_parser
from gemini_cli.operator import IDENTITY_ENV


def _options_of(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> Any:
    seen: list[Any] = []
    monkeypatch.setattr(gemini_operator.runtime.main, "run", seen.append)
    args = build_parser(argv).parse_args(argv)
    assert args.func(args) == 0
    (options,) = seen
    return options


def test_the_identity_comes_from_the_environment_the_chart_sets(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(IDENTITY_ENV, "gemini-operator-7d9f_0a1b")
    assert _options_of(["operator", "run"], monkeypatch).identity == "gemini-operator-7d9f_0a1b"


def test_the_flag_wins_and_without_either_each_process_is_its_own(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(IDENTITY_ENV, "from-env")
    assert _options_of(["operator", "run", "--identity", "mine"], monkeypatch).identity == "mine"
    monkeypatch.delenv(IDENTITY_ENV)
    assert _options_of(["operator", "run"], monkeypatch).identity == ""  # main: host-pid-random
