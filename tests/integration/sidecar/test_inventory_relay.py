"""The operator's batched poll of a large job (issue 17): one sidecar per batch relays the
inventories of the others (POST /inventories). Real sidecars on loopback, the operator's own
client code; batches made small so that a few sidecars show every path."""

from __future__ import annotations

import asyncio
import json

import pytest

from gemini.control import auth, inventory
from gemini.control.client import signed_header
from gemini.control.signing import (
    CONTROL_PUBLIC_KEY_ENV,
    Signer,
    control_public_key,
    public_key_setting,
)
from gemini.control.verifier import RequestVerifier
from gemini_operator.calls import sidecars as calls
from tests.integration.sidecar.conftest import TOKEN, free_port, make_config, started
from tests.integration.sidecar.test_api_hostile_input import _post

pytestmark = pytest.mark.integration
CONTROL = "control-token-0123456789-abcdef"
OPERATOR = Signer.operator(CONTROL)
WORLD = 5


def _configs(tmp_path):
    ports = {r: free_port() for r in range(WORLD)}
    return [make_config(r, WORLD, tmp_path, ports,
                        control_public_key=public_key_setting(
                            {CONTROL_PUBLIC_KEY_ENV: control_public_key(CONTROL)}))
            for r in range(WORLD)]


async def test_batches_are_relayed_and_a_silent_sidecar_is_named(tmp_path):
    *live, _ = _configs(tmp_path)  # rank 4 never starts: its address refuses connections
    async with started(*live) as cars:
        targets = {c.cfg.rank: ("127.0.0.1", c.api_port) for c in cars}
        targets[4] = ("127.0.0.1", free_port())
        found, silent = await asyncio.to_thread(
            # batches [0 1 2] [3 4]
            calls.inventories_each, targets, auth.Credentials(CONTROL), 2.0, 2, 3)
    assert sorted(found) == [0, 1, 2, 3]
    assert all(found[r].rank == r and found[r].world_size == WORLD for r in found)
    assert len(silent) == 1 and silent[0].startswith("rank 4: ") and "unreachable" in silent[0]


async def test_a_batch_whose_relay_is_silent_is_asked_rank_by_rank(tmp_path):
    configs = _configs(tmp_path)
    async with started(*(c for c in configs if c.rank != 3)) as cars:
        targets = {c.cfg.rank: ("127.0.0.1", c.api_port) for c in cars}
        targets[3] = ("127.0.0.1", free_port())  # the relay of batch [3 4]
        found, silent = await asyncio.to_thread(
            calls.inventories_each, targets, auth.Credentials(CONTROL), 2.0, 2, 3)
    assert sorted(found) == [0, 1, 2, 4]
    assert len(silent) == 1 and silent[0].startswith("rank 3: ")


async def test_a_relayed_answer_for_the_wrong_rank_is_not_taken(tmp_path):
    async with started(*_configs(tmp_path)[:2]) as cars:
        body = json.dumps({"sidecars": {"3": f"127.0.0.1:{cars[1].api_port}"},
                           "timeout_seconds": 1.0}).encode()
        status, raw = await asyncio.to_thread(_as_operator, cars[0].api_port, body)
    assert status == 200
    answer = inventory.InventoriesAnswer.from_json(json.loads(raw))
    assert sorted(answer.inventories) == [0]
    assert "inventory of rank 1" in answer.failed[3]


async def test_only_the_operator_may_relay_and_bad_requests_are_refused(tmp_path):
    async with started(*_configs(tmp_path)[:1]) as (car,):
        port = car.api_port
        ok = json.dumps({"sidecars": {}, "timeout_seconds": 1.0}).encode()
        many = json.dumps({"sidecars": {str(r): "127.0.0.1:9" for r in range(300)},
                           "timeout_seconds": 1.0}).encode()
        bad = json.dumps({"sidecars": {"1": "http://x"}, "timeout_seconds": 1.0}).encode()
        slow = json.dumps({"sidecars": {}, "timeout_seconds": 60}).encode()

        job = (await asyncio.to_thread(_as_operator, port, ok, Signer.job(TOKEN)))[0]
        answers = [await asyncio.to_thread(_as_operator, port, b) for b in (ok, many, bad, slow)]
    assert job == 401, "another pod of the job must not make a sidecar call out for it"
    assert answers[0][0] == 200
    assert [a[0] for a in answers[1:]] == [400, 400, 400]
    assert b"at most 256" in answers[1][1] and b"host:port" in answers[2][1]


async def test_an_answer_split_across_packets_is_read_whole(tmp_path):
    """Issue 45, item 6: a sidecar's inventory that arrives in several pieces (as a large one
    does over a real network) is relayed, not filed as "not an inventory"."""
    async with started(*_configs(tmp_path)[:2]) as cars:
        # rank 1's real answer, fetched once, then served in three pieces 50 ms apart
        status, raw = await asyncio.to_thread(_get, cars[1].api_port, "/inventory")
        assert status == 200

        asked: list[bytes] = []

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            asked.append(await reader.readuntil(b"\r\n\r\n"))
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                         b"Content-Length: " + str(len(raw)).encode() + b"\r\n\r\n")
            third = len(raw) // 3
            for piece in (raw[:third], raw[third:2 * third], raw[2 * third:]):
                writer.write(piece)
                await writer.drain()
                await asyncio.sleep(0.05)
            writer.close()

        slow = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = slow.sockets[0].getsockname()[1]
        body = json.dumps({"sidecars": {"1": f"127.0.0.1:{port}"},
                           "timeout_seconds": 2.0}).encode()
        async with slow:
            status, answer_raw = await asyncio.to_thread(_as_operator, cars[0].api_port, body)
    assert status == 200
    # issue 45, item 3: the relay's request signed for the address it asked, no token in it
    [request] = asked
    assert TOKEN not in request and b"Bearer" not in request
    header = next(line.split(b": ", 1)[1] for line in request.split(b"\r\n")
                  if line.lower().startswith(b"authorization:"))
    signed = RequestVerifier(TOKEN, None).check(header, "GET", "/inventory", f"127.0.0.1:{port}")
    assert signed is not None
    answer = inventory.InventoriesAnswer.from_json(json.loads(answer_raw))
    assert answer.failed == {} and sorted(answer.inventories) == [0, 1]
    assert answer.inventories[1].rank == 1


def _as_operator(port: int, body: bytes, signer: Signer = OPERATOR) -> tuple[int, bytes]:
    header = signed_header(signer, "POST", "/inventories", f"127.0.0.1:{port}", body)
    return _post(port, "/inventories", body, header.encode())


def _get(port: int, path: str) -> tuple[int, bytes]:
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    conn.request("GET", path, headers={"Authorization": f"Bearer {TOKEN.decode()}"})
    answer = conn.getresponse()
    status, raw = answer.status, answer.read()
    conn.close()
    return status, raw
