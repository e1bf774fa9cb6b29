"""The client's strict JSON (gemini.control.strict.parse_json) and its refusal log: deep nesting,
non-finite numbers and malformed text are ValueErrors, never another exception; a refusal is
logged once, loudly the first time in a while per address and kind."""

from __future__ import annotations

import logging

import pytest

from gemini.control import client
from gemini.control.strict import MAX_JSON_DEPTH, parse_json


@pytest.mark.parametrize(("raw", "words"), [
    (b"[" * 100_000 + b"]" * 100_000, "nested deeper than"),
    (b"[" * (MAX_JSON_DEPTH + 1) + b"]" * (MAX_JSON_DEPTH + 1), "nested deeper than"),
    (b'{"a": ' * (MAX_JSON_DEPTH + 1) + b"1" + b"}" * (MAX_JSON_DEPTH + 1),
     "nested deeper than"),
    (b'{"x": 1e999}', "out of range"),
    (b'{"x": -1e999}', "out of range"),
    (b'{"x": NaN}', "NaN is not a JSON number"),
    (b'{"x": Infinity}', "Infinity is not a JSON number"),
    (b'{"x": -Infinity}', "-Infinity is not a JSON number"),
    (b'{"x": ' + b"9" * 5000 + b"}", "digits"),
    (b'{"x": "\xff"}', "utf-8"),
    (b'{"x": 1', "Expecting"),
    (b"", "Expecting value"),
], ids=["deep-array", "just-too-deep", "deep-object", "1e999", "-1e999", "NaN", "Infinity",
        "-Infinity", "huge-integer", "not-utf-8", "truncated", "empty"])
def test_what_strict_parsing_refuses_is_a_value_error(raw: bytes, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        parse_json(raw)


def test_plain_json_up_to_the_depth_limit_parses_as_json_does() -> None:
    deepest = b"[" * MAX_JSON_DEPTH + b"]" * MAX_JSON_DEPTH
    assert parse_json(deepest) is not None
    assert parse_json(b'{"a": [1, 2.5, -0.0, 1e308, "s", null, true]}') == {
        "a": [1, 2.5, -0.0, 1e308, "s", None, True]}
    assert parse_json(bytearray(b"[]")) == [] and parse_json(b'"x"') == "x"


def test_a_refusal_is_logged_loudly_once_per_address_and_kind_in_a_while(
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    caplog.set_level(logging.DEBUG, "gemini.control")
    refusals = client._RefusalLog()
    refusals.note("10.0.0.1:7071", "/inventory", "deadline", "no whole answer")
    refusals.note("10.0.0.1:7071", "/inventory", "deadline", "no whole answer")
    refusals.note("10.0.0.1:7071", "/inventory", "too large", "answered 9 bytes")
    refusals.note("10.0.0.2:7071", "/inventory", "deadline", "no whole answer")
    monkeypatch.setattr(client, "REFUSAL_LOG_SECONDS", 0.0)  # the while has passed
    refusals.note("10.0.0.1:7071", "/status", "deadline", "no whole answer")
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("WARNING", "refused the answer of 10.0.0.1:7071/inventory (deadline): no whole answer"),
        ("DEBUG", "refused the answer of 10.0.0.1:7071/inventory (deadline): no whole answer"),
        ("WARNING", "refused the answer of 10.0.0.1:7071/inventory (too large): answered 9 bytes"),
        ("WARNING", "refused the answer of 10.0.0.2:7071/inventory (deadline): no whole answer"),
        ("WARNING", "refused the answer of 10.0.0.1:7071/status (deadline): no whole answer"),
    ]
