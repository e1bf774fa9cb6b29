"""Only the operator drives a sidecar (issue 14, per-rank identity): with the control token's
digest set, the job token every pod holds may read and make the trainer's own calls, nothing
else; the operator's control token may make every call. Raw HTTP to an in-process sidecar."""

from __future__ import annotations

import asyncio
import json

import pytest

from gemini.control import auth
from tests.integration.sidecar.conftest import TOKEN, free_port, make_config, started
from tests.integration.sidecar.test_api_hostile_input import _http, _post

pytestmark = pytest.mark.integration
CONTROL = b"control-token-0123456789-abcdef"
PEERS_BODY = json.dumps({"peers": {}, "hold_ranks": [], "send_to": []}).encode()


def _get(port: int, path: str, token: bytes) -> int:
    return _http(port, b"GET " + path.encode() + b" HTTP/1.1\r\nHost: sidecar\r\nConnection: "
                 b"close\r\nAuthorization: Bearer " + token + b"\r\n\r\n")[0]


async def test_the_job_token_reads_and_notifies_but_only_the_control_token_drives(tmp_path):
    cfg = make_config(0, 2, tmp_path, {0: free_port(), 1: free_port()},
                      control_sha256=auth.control_digest(CONTROL.decode()))
    async with started(cfg) as (car,):
        port = car.api_port

        def calls() -> list[int]:
            return [
                _get(port, "/inventory", TOKEN),
                _post(port, "/notify", b'{"version": 0}', b"Bearer " + TOKEN)[0],
                _post(port, "/peers", PEERS_BODY, b"Bearer " + TOKEN)[0],  # another pod's reach
                _post(port, "/restore", b"{}", b"Bearer " + TOKEN)[0],
                _post(port, "/peers", PEERS_BODY, b"Bearer " + CONTROL)[0],  # the operator
                _get(port, "/inventory", CONTROL),
                _post(port, "/peers", PEERS_BODY, b"Bearer " + CONTROL[:-1])[0],
            ]

        inventory, notify, peers_job, restore_job, peers_ctl, inventory_ctl, peers_bad = (
            await asyncio.to_thread(calls))
    assert (inventory, inventory_ctl, peers_ctl) == (200, 200, 200)
    assert notify not in (401, 403)  # the trainer's notice goes through (its answer aside)
    assert (peers_job, restore_job, peers_bad) == (401, 401, 401)


async def test_without_the_digest_the_job_token_still_does_everything(tmp_path):
    """Pods made by an operator older than control tokens."""
    cfg = make_config(0, 2, tmp_path, {0: free_port(), 1: free_port()})
    async with started(cfg) as (car,):
        status, _ = await asyncio.to_thread(_post, car.api_port, "/peers", PEERS_BODY,
                                            b"Bearer " + TOKEN)
    assert status == 200
