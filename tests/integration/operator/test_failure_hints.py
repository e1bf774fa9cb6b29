"""A launcher whose training fails tells the operator's hint server at once (real sockets, a
real launcher and child process, the operator's real aiohttp server): the operator polls that
job without waiting for its next round. A hint without the job's token, for another job of
that name, or from a replica that does not lead starts no poll."""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from gemini.control import paths
from gemini.control.client import ControlClient, ControlError, signed_header
from gemini.control.launcher import FailureHint
from gemini.control.signing import HINTS_AUDIENCE, Signer
from gemini_operator.calls.hints import HintGate, HintServer
from gemini_operator.cluster.cache import JobKey
from gemini_operator.core.render import JobRef
from gemini_trainer.failure_hint import FailureHints
from gemini_trainer.launch_config import LauncherConfig
from gemini_trainer.launcher import Launcher

pytestmark = pytest.mark.integration

TOKEN, UID, KEY = "job-token-0123456789abcdef", "uid-1", ("team", "llm")


@dataclass
class Operator:
    server: HintServer
    polled: list[tuple[JobKey, float]] = field(default_factory=list)
    results: list[str] = field(default_factory=list)
    leading: bool = True

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.port}"


@pytest.fixture()
async def operator() -> AsyncIterator[Operator]:
    tokens = {JobRef("llm", "team", UID): TOKEN}
    holder: list[Operator] = []

    def poll_now(key: JobKey) -> None:
        holder[0].polled.append((key, time.monotonic()))

    server = HintServer(lambda key: UID if key == KEY else None, tokens.get, poll_now,
                        lambda: holder[0].leading, gate=HintGate(0.5),
                        observe=lambda result: holder[0].results.append(result))
    holder.append(Operator(server))
    await server.start("127.0.0.1", 0)
    yield holder[0]
    await server.stop()


def hint_env(url: str, **overrides: str) -> dict[str, str]:
    return {"GEMINI_OPERATOR_HINT_URL": url, "GEMINI_AUTH_TOKEN": TOKEN,
            "GEMINI_NAMESPACE": "team", "GEMINI_JOB": "llm", "GEMINI_JOB_UID": UID,
            "GEMINI_RANK": "1", **overrides}


async def until(predicate: Callable[[], Any], timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("not reached in time")
        await asyncio.sleep(0.02)


async def test_a_launcher_whose_process_died_gets_its_job_polled_at_once(
        operator: Operator) -> None:
    hints = FailureHints.from_env(hint_env(operator.url))
    assert hints is not None
    config = LauncherConfig(command=(sys.executable, "-c", "import sys; sys.exit(3)"), port=0,
                            token=TOKEN, hold_standby=False, hints=hints)
    launcher = Launcher(config)
    runner = threading.Thread(target=launcher.run, daemon=True)
    started = time.monotonic()
    runner.start()
    try:
        await until(lambda: operator.polled)
        (key, when), = operator.polled
        assert key == KEY and operator.results == ["polled"]
        assert launcher.status()["state"] == "exited"
        assert when - started < 5.0
    finally:
        launcher.stop()
        launcher.finish()
        await asyncio.to_thread(runner.join, 10)


async def send(operator: Operator, token: str = TOKEN, **fields: Any) -> int:
    hint = FailureHint(**{"namespace": "team", "job": "llm", "uid": UID, "rank": 0,
                          "epoch": 2, **fields})
    client = ControlClient.for_url(operator.url, token, timeout=5, audience=HINTS_AUDIENCE)
    try:
        await asyncio.to_thread(client.failure_hint, hint)
        return 202
    except ControlError as err:
        assert err.status is not None, err
        return err.status


async def test_hints_without_the_token_of_that_very_job_start_no_poll(
        operator: Operator) -> None:
    assert await send(operator, token="another-jobs-token-0123456") == 401
    assert await send(operator, token="") == 401
    assert await send(operator, uid="uid-of-an-older-job") == 404
    assert await send(operator, job="other") == 404
    operator.leading = False
    assert await send(operator) == 503
    assert operator.polled == []
    assert operator.results == ["unauthorized", "unauthorized", "unknown", "unknown",
                                "not-leader"]


async def test_repeated_hints_poll_a_job_at_most_once_per_interval(operator: Operator) -> None:
    assert [await send(operator) for _ in range(5)] == [202] * 5
    assert len(operator.polled) == 1 and operator.results[1:] == ["throttled"] * 4
    await asyncio.sleep(0.55)
    assert await send(operator) == 202 and len(operator.polled) == 2


@pytest.mark.parametrize("body", [b"[]", b'{"namespace": "team"}', b"{" * 5000,
                                  b"x" * (paths.MAX_HINT_BYTES + 1)])
async def test_malformed_or_oversized_hints_are_refused(operator: Operator, body: bytes) -> None:
    def post() -> int:
        import http.client

        conn = http.client.HTTPConnection("127.0.0.1", operator.server.port, timeout=5)
        target = f"{paths.FAILURE_HINT_PATH}?namespace=team&job=llm&uid={UID}"
        conn.request("POST", target, body=body, headers={"Authorization": signed_header(
            Signer.job(TOKEN), "POST", target, HINTS_AUDIENCE, body)})
        status = conn.getresponse().status
        conn.close()
        return status

    assert await asyncio.to_thread(post) in (400, 413)
    assert operator.polled == []


async def test_a_recorded_hint_is_refused_again_and_a_bearer_token_is_nobodys(
        operator: Operator) -> None:
    """Issue 45, item 3: the job token never crosses the network, and a recorded hint is of
    no use: replayed, or with another body, it is refused."""
    target = f"{paths.FAILURE_HINT_PATH}?namespace=team&job=llm&uid={UID}"
    body = json.dumps(FailureHint("team", "llm", UID, 0, 2).to_json()).encode()
    recorded = signed_header(Signer.job(TOKEN), "POST", target, HINTS_AUDIENCE, body)

    def post(header: str, sent: bytes = body) -> int:
        import http.client

        conn = http.client.HTTPConnection("127.0.0.1", operator.server.port, timeout=5)
        conn.request("POST", target, body=sent, headers={"Authorization": header})
        status = conn.getresponse().status
        conn.close()
        return status

    assert TOKEN not in recorded
    assert await asyncio.to_thread(post, recorded) == 202
    assert await asyncio.to_thread(post, recorded) == 401  # replayed
    other = json.dumps(FailureHint("team", "llm", UID, 1, 2).to_json()).encode()
    fresh = signed_header(Signer.job(TOKEN), "POST", target, HINTS_AUDIENCE, body)
    assert await asyncio.to_thread(post, fresh, other) == 400  # not the body signed
    assert await asyncio.to_thread(post, f"Bearer {TOKEN}") == 401
    assert len(operator.polled) == 1
