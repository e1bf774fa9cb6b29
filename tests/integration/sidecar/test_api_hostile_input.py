"""The HTTP API answers hostile input with a 4xx, never a 500 (issue 14, item 7): a
non-UTF-8 Authorization header, numbers out of range (1e999, NaN), JSON nested deep, versions
past what slot files hold (2^63 and up), a body that never finishes. Raw HTTP over loopback
to an in-process sidecar."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import pytest

from gemini_sidecar.config import ServerLimits
from tests.integration.sidecar.conftest import TOKEN, free_port, make_config, started

pytestmark = pytest.mark.integration
BEARER = b"Bearer " + TOKEN
POST_PATHS = ("/notify", "/v1/local/committed", "/peers", "/profile", "/fetch",
              "/fetch-replicas", "/persist", "/commit", "/restore")


def _http(port: int, request: bytes, wait_s: float = 10) -> tuple[int, bytes]:
    """Send one raw request; (status, body) of the answer (read up to its Content-Length)."""
    with socket.create_connection(("127.0.0.1", port), timeout=wait_s) as sock:
        sock.sendall(request)
        answer = b""
        while b"\r\n\r\n" not in answer or len(answer) < _answer_length(answer):
            chunk = sock.recv(65536)
            assert chunk, f"closed before a whole answer: {answer!r}"
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


def _answer_length(answer: bytes) -> int:
    head, _, _ = answer.partition(b"\r\n\r\n")
    lines = head.lower().split(b"\r\n")
    length = next(int(x.split(b":")[1]) for x in lines if x.startswith(b"content-length:"))
    return len(head) + 4 + length


def _post(port: int, path: str, body: bytes, auth: bytes = BEARER) -> tuple[int, bytes]:
    return _http(port, b"POST " + path.encode() + b" HTTP/1.1\r\nHost: sidecar\r\n"
                 b"Connection: close\r\nAuthorization: " + auth + b"\r\nContent-Length: "
                 + str(len(body)).encode() + b"\r\n\r\n" + body)


async def _answers(port: int, requests: list[tuple[str, bytes]]) -> list[tuple[int, bytes]]:
    return [await asyncio.to_thread(_post, port, path, body) for path, body in requests]


@pytest.fixture
async def api_port(tmp_path):
    ports = {0: free_port(), 1: free_port()}
    limits = ServerLimits(read_timeout_s=1.0)
    async with started(make_config(0, 2, tmp_path, ports, hold=(1,), send_to=(1,),
                                   traffic_mode="interleaved", limits=limits)) as (car,):
        yield car.api_port


async def test_an_authorization_header_that_is_not_utf8_is_refused_with_401(api_port):
    for auth in (b"Bearer \xff\xfe\xfd", b"\xc3\x28" + TOKEN, BEARER[:-1] + b"\x80"):
        status, body = await asyncio.to_thread(_post, api_port, "/notify", b"{}", auth)
        assert status == 401, body


@pytest.mark.parametrize("number", [b"1e999", b"-1e999", b"NaN", b"Infinity"])
async def test_numbers_out_of_range_are_refused_with_400(api_port, number):
    bodies = [
        ("/notify", b'{"version": 1, "stall_seconds": %s}' % number),
        ("/profile", b'{"iterations": [{"length": %s, "ops": [[0, 0.1]]}]}' % number),
        ("/profile", b'{"iterations": [{"length": 1.0, "ops": [[0, %s]]}]}' % number),
        ("/fetch", b'{"rank": 1, "version": %s}' % number),
        ("/persist", b'{"version": %s}' % number),
    ]
    for (path, _), (status, body) in zip(bodies, await _answers(api_port, bodies), strict=True):
        assert status == 400, (path, body)
        assert b"out of range" in body or b"not a JSON number" in body, body


async def test_json_nested_deep_is_refused_with_400_on_every_path(api_port):
    deep = [(path, b"[" * 100_000 + b"]" * 100_000) for path in POST_PATHS]
    deep += [(path, b'{"a":' * 40 + b"1" + b"}" * 40) for path in POST_PATHS]
    for (path, _), (status, body) in zip(deep, await _answers(api_port, deep), strict=True):
        assert status == 400, (path, body)
        assert json.loads(body)["error"].endswith("nested deeper than 32"), body


async def test_versions_past_what_a_slot_file_holds_are_refused_with_400(api_port):
    too_big = [(path, json.dumps({"rank": 1, "version": v}).encode())
               for path in ("/notify", "/fetch", "/fetch-replicas", "/persist", "/commit",
                            "/restore")
               for v in (1 << 64, 1 << 63)]
    for (path, _), (status, body) in zip(too_big, await _answers(api_port, too_big),
                                         strict=True):
        assert status == 400, (path, body)
        assert b"between 0 and 2^63-1" in body, body
    largest = json.dumps({"version": (1 << 63) - 1}).encode()
    assert (await asyncio.to_thread(_post, api_port, "/notify", largest))[0] == 202


async def test_a_body_that_stops_short_is_answered_408_at_the_read_timeout(api_port):
    request = (b"POST /notify HTTP/1.1\r\nHost: sidecar\r\nAuthorization: " + BEARER +
               b"\r\nContent-Length: 100\r\n\r\n" + b'{"version": ')
    started_at = time.monotonic()
    status, body = await asyncio.to_thread(_http, api_port, request, 5)
    assert status == 408, body
    assert time.monotonic() - started_at < 1 + 1  # the read timeout (1 s) and some slack
