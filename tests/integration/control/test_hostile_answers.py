"""ControlClient against hostile peers on loopback (a job's author picks the images the
operator calls): an answer dripped a byte at a time ends at the call's deadline, a 300 MiB
answer is refused in bounded memory before it is all read, and deep, non-finite or
non-object JSON is a ControlError like every other bad answer; each refusal is logged once,
with the address and the reason, never with the token."""

from __future__ import annotations

import json
import logging
import time
import tracemalloc
from collections.abc import Callable
from typing import Any

import pytest

from gemini.control import client as control_client
from gemini.control.client import ControlClient, ControlError
from tests.integration.control.hostile import (
    Behaviour,
    MiB,
    answer,
    drip_body,
    drip_head,
    huge,
    serving,
)
from tests.unit.control.test_types import STATUS

pytestmark = pytest.mark.integration

TOKEN = "s3cr3t-job-token"
DEADLINE = 1.0
SLACK = 0.5  # thread wake-ups and the refusal itself, on 2 loaded cores


def _client(port: int, timeout: float = DEADLINE) -> ControlClient:
    return ControlClient("127.0.0.1", port, TOKEN, timeout=timeout)


def _status_with(exited_at: str) -> bytes:
    """The launcher's /status answer with `exited_at` written as raw JSON text."""
    doc = STATUS.to_json()
    doc["exited_at"] = "@"
    return json.dumps(doc).replace('"@"', exited_at).encode()


@pytest.mark.parametrize("behaviour", [drip_head(), drip_body()], ids=["head", "body"])
def test_an_answer_dripped_byte_by_byte_ends_at_the_calls_deadline(
        behaviour: Behaviour) -> None:
    with serving(behaviour) as server:
        started = time.monotonic()
        with pytest.raises(ControlError, match=f"no whole answer within {DEADLINE:g} s"):
            _client(server.port).inventory()
        took = time.monotonic() - started
    assert DEADLINE - 0.05 <= took < DEADLINE + SLACK, took


@pytest.mark.parametrize("framing", ["length", "chunked", "close"])
def test_a_300_mib_answer_is_refused_in_bounded_memory_before_it_is_all_read(
        framing: str) -> None:
    with serving(huge(300 * MiB, framing)) as server:
        tracemalloc.start()
        try:
            started = time.monotonic()
            with pytest.raises(ControlError, match="bytes") as err:
                _client(server.port, timeout=30).inventory()
            took = time.monotonic() - started
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        time.sleep(0.2)  # the server notices the hang-up
        sent = server.sent
    assert "more than the" in err.value.reason and err.value.status is None
    assert peak < 8 * MiB, f"peak {peak / MiB:.1f} MiB"
    assert sent < 64 * MiB, f"the server got to send {sent / MiB:.0f} MiB"
    assert took < 5, took


def test_an_oversized_refusal_body_is_refused_too() -> None:
    raw = b'{"error": "' + b"x" * (control_client.MAX_ERROR_ANSWER_BYTES + 1) + b'"}'
    with serving(answer(raw, status=500)) as server, pytest.raises(
            ControlError, match="more than the"):
        _client(server.port).status()


DEEP = b"[" * 100_000 + b"]" * 100_000
BAD_JSON: list[tuple[str, bytes, str]] = [
    ("deep beyond the interpreter's limit", DEEP, "nested deeper than"),
    ("deep within the interpreter's limit", b"[" * 500 + b"]" * 500, "nested deeper than"),
    ("deep inside a field", _status_with("[" * 200 + "]" * 200), "nested deeper than"),
    ("1e999", _status_with("1e999"), "out of range"),
    ("-1e999", _status_with("-1e999"), "out of range"),
    ("NaN", _status_with("NaN"), "NaN is not a JSON number"),
    ("Infinity", _status_with("Infinity"), "Infinity is not a JSON number"),
    ("a huge integer", _status_with("9" * 5000), "not JSON"),
    ("not UTF-8", b'{"state": "\xff"}', "not JSON"),
]


@pytest.mark.parametrize("call", [ControlClient.status, ControlClient.call_json],
                         ids=["typed", "call_json"])
@pytest.mark.parametrize(("raw", "words"), [b[1:] for b in BAD_JSON],
                         ids=[b[0] for b in BAD_JSON])
def test_deep_or_non_finite_json_is_the_clients_error(
        call: Callable[..., Any], raw: bytes, words: str) -> None:
    with serving(answer(raw)) as server, pytest.raises(ControlError, match=words) as err:
        call(_client(server.port), *(["/status"] if call is ControlClient.call_json else []))
    assert err.value.address == f"127.0.0.1:{server.port}" and err.value.status is None


@pytest.mark.parametrize("raw", [b"[1, 2]", b'"ok"', b"null", b"7"],
                         ids=["list", "string", "null", "number"])
def test_an_answer_that_is_not_an_object_is_the_clients_error(raw: bytes) -> None:
    with serving(answer(raw)) as server:
        client = _client(server.port)
        with pytest.raises(ControlError, match="must be a JSON object"):
            client.call_json("/anything")
        with pytest.raises(ControlError, match="must be a JSON object"):
            client.status()


def _echo_token(status: int) -> Behaviour:
    """A peer that repeats the caller's credentials back in its answer."""
    return answer(b'{"error": "Bearer ' + TOKEN.encode() + b'", "state": ["' + TOKEN.encode()
                  + b'"]}', status)


@pytest.mark.parametrize("status", [200, 401])
def test_no_error_or_log_line_carries_the_token_a_peer_echoed(
        status: int, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, "gemini.control")
    with serving(_echo_token(status)) as server, pytest.raises(ControlError) as err:
        _client(server.port).status()
    texts = [str(err.value), err.value.reason, str(err.value.detail), caplog.text]
    assert not [t for t in texts if TOKEN in t]
    assert "<token>" in str(err.value)


def test_each_refusal_is_logged_once_with_the_address_and_the_reason_repeats_quietly(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, "gemini.control")
    with serving(answer(b"[" * 100 + b"]" * 100)) as server:
        for _ in range(3):
            with pytest.raises(ControlError):
                _client(server.port).inventory()
    records = [r for r in caplog.records if r.name == "gemini.control"]
    assert [r.levelno for r in records] == [logging.WARNING, logging.DEBUG, logging.DEBUG]
    for record in records:
        message = record.getMessage()
        assert f"127.0.0.1:{server.port}/inventory" in message, message
        assert "nested deeper than" in message, message
