"""Only the operator drives a sidecar (issue 14, per-rank identity; issue 45, item 3: signed,
no token on the wire): with the operator's public key set, the job token every pod holds may
read and make the trainer's own calls, nothing else; the operator's signature may make every
call. A recorded request is refused again, at another address, or with another body; the
control token sent as a bearer is nobody's. Raw HTTP to an in-process sidecar."""

from __future__ import annotations

import asyncio
import json

import pytest

from gemini.control.client import signed_header
from gemini.control.signing import CONTROL_PUBLIC_KEY_ENV, Signer, public_key_setting
from gemini.control.signing import control_public_key as public_key
from tests.integration.sidecar.conftest import TOKEN, free_port, make_config, started
from tests.integration.sidecar.test_api_hostile_input import _http, _post

pytestmark = pytest.mark.integration
CONTROL = "control-token-0123456789-abcdef"
PEERS_BODY = json.dumps({"peers": {}, "hold_ranks": [], "send_to": []}).encode()
OPERATOR, JOB = Signer.operator(CONTROL), Signer.job(TOKEN)


def _key():  # what the operator puts in the pod's environment
    return public_key_setting({CONTROL_PUBLIC_KEY_ENV: public_key(CONTROL)})


def _get(port: int, path: str, auth: bytes) -> int:
    return _http(port, b"GET " + path.encode() + b" HTTP/1.1\r\nHost: sidecar\r\nConnection: "
                 b"close\r\nAuthorization: " + auth + b"\r\n\r\n")[0]


def _signed(signer: Signer, method: str, path: str, port: int, body: bytes = b"") -> bytes:
    return signed_header(signer, method, path, f"127.0.0.1:{port}", body).encode()


async def test_the_job_signs_reads_and_notices_but_only_the_operator_drives(tmp_path):
    cfg = make_config(0, 2, tmp_path, {0: free_port(), 1: free_port()},
                      control_public_key=_key())
    async with started(cfg) as (car,):
        port = car.api_port

        def calls() -> list[int]:
            notice = b'{"version": 0}'
            return [
                _get(port, "/inventory", _signed(JOB, "GET", "/inventory", port)),
                _post(port, "/notify", notice, _signed(JOB, "POST", "/notify", port, notice))[0],
                _post(port, "/peers", PEERS_BODY,  # another pod's reach
                      _signed(JOB, "POST", "/peers", port, PEERS_BODY))[0],
                _post(port, "/restore", b"{}", _signed(JOB, "POST", "/restore", port, b"{}"))[0],
                _post(port, "/peers", PEERS_BODY,  # the operator
                      _signed(OPERATOR, "POST", "/peers", port, PEERS_BODY))[0],
                _get(port, "/inventory", _signed(OPERATOR, "GET", "/inventory", port)),
                _post(port, "/peers", PEERS_BODY, b"Bearer " + CONTROL.encode())[0],
            ]

        inventory, notify, peers_job, restore_job, peers_op, inventory_op, peers_bearer = (
            await asyncio.to_thread(calls))
    assert (inventory, inventory_op, peers_op) == (200, 200, 200)
    assert notify not in (401, 403)  # the trainer's notice goes through (its answer aside)
    assert (peers_job, restore_job, peers_bearer) == (401, 401, 401)


async def test_a_recorded_operator_call_is_refused_again_elsewhere_or_with_another_body(
        tmp_path):
    ports = {0: free_port(), 1: free_port()}
    cfgs = [make_config(r, 2, tmp_path, ports, control_public_key=_key()) for r in (0, 1)]
    async with started(*cfgs) as (car, other):

        def calls() -> list[int]:
            recorded = _signed(OPERATOR, "POST", "/peers", car.api_port, PEERS_BODY)
            return [
                _post(car.api_port, "/peers", PEERS_BODY, recorded)[0],
                _post(car.api_port, "/peers", PEERS_BODY, recorded)[0],  # replayed
                _post(other.api_port, "/peers", PEERS_BODY,  # at another pod
                      _signed(OPERATOR, "POST", "/peers", car.api_port, PEERS_BODY))[0],
                _post(car.api_port, "/peers", PEERS_BODY.replace(b"[]", b"[1]", 1),  # altered
                      _signed(OPERATOR, "POST", "/peers", car.api_port, PEERS_BODY))[0],
            ]

        first, again, elsewhere, altered = await asyncio.to_thread(calls)
    assert first == 200 and (again, elsewhere) == (401, 401)
    assert altered == 400


async def test_without_the_public_key_the_job_token_still_does_everything(tmp_path):
    """A sidecar started by hand, without the operator."""
    cfg = make_config(0, 2, tmp_path, {0: free_port(), 1: free_port()})
    async with started(cfg) as (car,):
        port = car.api_port
        status, _ = await asyncio.to_thread(_post, port, "/peers", PEERS_BODY,
                                            _signed(JOB, "POST", "/peers", port, PEERS_BODY))
        bearer, _ = await asyncio.to_thread(_post, port, "/peers", PEERS_BODY, b"Bearer " + TOKEN)
    assert status == 200
    assert bearer == 200  # from loopback: a trainer library older than signatures
