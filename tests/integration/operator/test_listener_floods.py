"""No pod can blind the operator (issue 45, item 1): its listeners hold up against clients that
never authenticate. Real servers on loopback, real sockets from several source addresses
(127.0.0.2-9, all loopback on Linux), a real operator call under descriptor exhaustion in a
process of its own."""

from __future__ import annotations

import asyncio
import json
import select
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator

import pytest

from gemini.control import paths
from gemini.control.client import ControlClient, signed_header
from gemini.control.launcher import FailureHint
from gemini.control.signing import HINTS_AUDIENCE, Signer
from gemini.serving import probes
from gemini.serving.gate import ConnectionLimits
from gemini_operator.calls import hints
from gemini_operator.calls.hints import HintGate, HintServer
from gemini_operator.core.render import JobRef
from gemini_operator.runtime.health import METRICS_LIMITS, Health, start_metrics_server
from gemini_operator.runtime.metrics import OperatorMetrics

pytestmark = pytest.mark.integration

TOKEN, UID = "job-token-0123456789abcdef", "uid-1"
FLOODERS = [f"127.0.0.{i}" for i in range(2, 10)]  # eight addresses, none the operator's


def connect_from(source: str, port: int) -> socket.socket:
    sock = socket.socket()
    sock.bind((source, 0))
    sock.settimeout(5)
    sock.connect(("127.0.0.1", port))
    return sock


def closed_by_server(sock: socket.socket, wait_s: float) -> bool:
    """Whether the server closed `sock` within `wait_s` (EOF or reset), sending nothing."""
    ready, _, _ = select.select([sock], [], [], wait_s)
    if not ready:
        return False
    try:
        return sock.recv(1) == b""
    except OSError:
        return True


def flood(port: int, per_address: int) -> list[socket.socket]:
    """`per_address` silent connections from each flooding address, all still held here."""
    return [connect_from(src, port) for src in FLOODERS for _ in range(per_address)]


def close_all(socks: list[socket.socket]) -> None:
    for sock in socks:
        sock.close()


def post_raw(port: int, head: str, body: bytes = b"", wait_s: float = 5) -> tuple[int, float]:
    """Send a raw request (the head, then `body`); the answer's status and how long it took."""
    started = time.monotonic()
    with connect_from("127.0.0.1", port) as sock:
        sock.settimeout(wait_s)
        sock.sendall(head.encode() + body)
        answer = sock.recv(4096)
    return int(answer.split(b" ", 2)[1]), time.monotonic() - started


@pytest.fixture()
async def hint_server(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[HintServer]:
    monkeypatch.setattr(hints, "READ_TIMEOUT_SECONDS", 0.5)
    monkeypatch.setattr(hints, "HEADER_TIMEOUT_SECONDS", 2.0)
    tokens = {JobRef("llm", "team", UID): TOKEN}
    server = HintServer(lambda key: UID if key == ("team", "llm") else None, tokens.get,
                        lambda key: None, lambda: True, gate=HintGate(0),
                        limits=ConnectionLimits(max_connections=1000, max_connections_per_host=4))
    await server.start("127.0.0.1", 0)
    yield server
    await server.stop()


def send_hint(port: int) -> float:
    """A launcher's hint, as the launcher sends it; how long it took."""
    client = ControlClient.for_url(f"http://127.0.0.1:{port}", TOKEN, timeout=5,
                                   audience=HINTS_AUDIENCE)
    started = time.monotonic()
    assert client.failure_hint(FailureHint("team", "llm", UID, 0, 1)).polling
    return time.monotonic() - started


async def test_a_flood_of_silent_connections_is_cut_per_address_and_hints_still_come_in(
        hint_server: HintServer) -> None:
    socks = await asyncio.to_thread(flood, hint_server.port, 6)
    try:
        closed = list(await asyncio.gather(*(asyncio.to_thread(closed_by_server, s, 0.3)
                                             for s in socks)))
        # per address: the first four held, the fifth and sixth closed at once
        assert closed == ([False] * 4 + [True] * 2) * len(FLOODERS)
        assert await asyncio.to_thread(send_hint, hint_server.port) < 1.0
        listener = hint_server.listener
        assert listener is not None
        for _ in range(100):  # the hint's own connection closes on the server's side
            if listener.gate.open == 32:
                break
            await asyncio.sleep(0.01)
        assert listener.gate.open == 32
        # silent connections are closed at the header timeout (2 s here)
        held = [s for s, c in zip(socks, closed, strict=True) if not c]
        assert all(await asyncio.gather(*(asyncio.to_thread(closed_by_server, s, 4)
                                          for s in held)))
    finally:
        close_all(socks)


async def test_a_wrong_token_is_refused_before_any_body_byte_is_read(
        hint_server: HintServer) -> None:
    head = (f"POST {paths.FAILURE_HINT_PATH}?namespace=team&job=llm&uid={UID} HTTP/1.1\r\n"
            "Host: x\r\nAuthorization: Bearer not-the-token-0123456789\r\n"
            "Content-Type: application/json\r\nContent-Length: 4000\r\n\r\n")
    status, took = await asyncio.to_thread(post_raw, hint_server.port, head)
    assert status == 401 and took < 1.0  # not waiting for the 4000 bytes that never come


async def test_a_body_that_does_not_come_is_given_up_at_the_read_deadline(
        hint_server: HintServer) -> None:
    target = f"{paths.FAILURE_HINT_PATH}?namespace=team&job=llm&uid={UID}"
    signed = signed_header(Signer.job(TOKEN), "POST", target, HINTS_AUDIENCE, b"x" * 4000)
    head = (f"POST {target} HTTP/1.1\r\nHost: x\r\nAuthorization: {signed}\r\n"
            "Content-Type: application/json\r\nContent-Length: 4000\r\n\r\n")
    status, took = await asyncio.to_thread(post_raw, hint_server.port, head, b'{"name')
    assert status == 400 and 0.4 < took < 2.0


async def test_a_hint_that_names_no_job_in_its_query_is_refused_unread(
        hint_server: HintServer) -> None:
    signed = signed_header(Signer.job(TOKEN), "POST", paths.FAILURE_HINT_PATH, HINTS_AUDIENCE,
                           b"x" * 4000)
    head = (f"POST {paths.FAILURE_HINT_PATH} HTTP/1.1\r\nHost: x\r\n"
            f"Authorization: {signed}\r\nContent-Length: 4000\r\n\r\n")
    status, took = await asyncio.to_thread(post_raw, hint_server.port, head)
    assert status == 400 and took < 1.0


def probe(port: int, path: str = "/healthz") -> tuple[int, float]:
    return post_raw(port, f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n")


async def test_probes_are_answered_while_both_ports_are_flooded(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(probes, "PROBE_DEADLINE_S", 1.0)
    health = Health()
    health.beat()
    metrics = OperatorMetrics()
    server = await asyncio.to_thread(
        start_metrics_server, 0, metrics.registry, health, "127.0.0.1", 0,
        metrics.connections_refused.labels)
    assert server.probe_port is not None
    socks: list[socket.socket] = []
    try:
        per_host = METRICS_LIMITS.max_connections_per_host
        socks += await asyncio.to_thread(flood, server.port, per_host + 2)
        socks += await asyncio.to_thread(flood, server.probe_port, probes.PROBES_PER_HOST + 2)
        status, took = await asyncio.to_thread(probe, server.probe_port)
        assert status == 200 and took < 1.0
        refused = metrics.connections_refused
        assert refused.labels("metrics")._value.get() == 2 * len(FLOODERS)
        assert refused.labels("probes")._value.get() >= 2 * len(FLOODERS)
        # a silent probe connection is closed at its deadline (1 s here): holding them costs a
        # flood a new connection every second
        held = socks[-len(FLOODERS) * (probes.PROBES_PER_HOST + 2):]
        assert all(await asyncio.gather(*(asyncio.to_thread(closed_by_server, s, 3)
                                          for s in held)))
        assert (await asyncio.to_thread(probe, server.probe_port, "/metrics"))[0] == 404
    finally:
        close_all(socks)
        await asyncio.to_thread(server.stop)


EXHAUSTED = """
import json, resource, socket, sys
from gemini_operator.calls.sidecars import refusing
live, dead = int(sys.argv[1]), int(sys.argv[2])
before = sorted(refusing({0: [("127.0.0.1", live)], 1: [("127.0.0.1", dead)]}, 1.0))
resource.setrlimit(resource.RLIMIT_NOFILE, (128, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
held = []
try:
    while True:
        held.append(socket.socket())
except OSError:
    pass
during = sorted(refusing({0: [("127.0.0.1", live)], 1: [("127.0.0.1", dead)]}, 1.0))
print(json.dumps({"before": before, "during": during}))
"""


def test_the_operator_out_of_descriptors_presumes_no_node_lost() -> None:
    with socket.socket() as live, socket.socket() as dead:
        live.bind(("127.0.0.1", 0))
        live.listen(8)
        dead.bind(("127.0.0.1", 0))  # bound, not listening: connections are refused
        ports = [str(s.getsockname()[1]) for s in (live, dead)]
        done = subprocess.run([sys.executable, "-c", EXHAUSTED, *ports], capture_output=True,
                              text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["before"] == [1]  # a refusing pod is found as before
    assert seen["during"] == []  # out of descriptors: nothing is known, nothing is presumed
    assert "not counted against the pod" in done.stderr
