"""The operator's /healthz and /readyz (the probes' endpoints), served beside /metrics."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from typing import Any

import pytest

from gemini_operator.runtime.health import Health, make_app, start_metrics_server
from gemini_operator.runtime.metrics import OperatorMetrics


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_not_live_before_the_event_loop_beats_nor_ready_before_start_up() -> None:
    clock = Clock()
    health = Health(clock, stall_seconds=60)
    assert not health.live().ok and "starting" in health.live().reason
    health.beat()
    assert health.live().ok
    assert not health.ready().ok and "start-up" in health.ready().reason
    health.started()
    assert health.ready().ok


def test_a_stalled_event_loop_fails_both() -> None:
    clock = Clock()
    health = Health(clock, stall_seconds=60)
    health.beat()
    health.started()
    clock.now += 61
    assert not health.live().ok and "61 s" in health.live().reason
    assert not health.ready().ok
    health.beat()
    assert health.live().ok


async def test_an_ended_loop_fails_liveness() -> None:
    health = Health()
    beating = asyncio.create_task(health.heartbeat())
    await asyncio.sleep(0)
    forever = asyncio.get_running_loop().create_future()
    crashed = asyncio.get_running_loop().create_future()
    health.watch("election", forever)
    health.watch("poll", crashed)
    health.started()
    assert health.live().ok and health.ready().ok
    crashed.set_exception(RuntimeError("boom"))
    assert health.live().reason == "loops ended: poll"
    assert not health.ready().ok
    beating.cancel()
    forever.cancel()
    with pytest.raises(asyncio.CancelledError):
        await beating


def _call(app: Any, path: str) -> tuple[str, dict[str, str], bytes]:
    answer: dict[str, Any] = {}

    def start_response(status: str, headers: list[tuple[str, str]]) -> None:
        answer.update(status=status, headers=dict(headers))

    body = b"".join(app({"PATH_INFO": path, "REQUEST_METHOD": "GET", "QUERY_STRING": ""},
                        start_response))
    return answer["status"], answer["headers"], body


def test_the_app_routes_the_probes_and_serves_metrics_elsewhere() -> None:
    clock = Clock()
    health = Health(clock)
    app = make_app(OperatorMetrics().registry, health)
    status, headers, body = _call(app, "/healthz")
    assert status.startswith("503") and json.loads(body)["status"] == "failing"
    health.beat()
    status, headers, body = _call(app, "/healthz")
    assert status == "200 OK" and headers["Content-Type"] == "application/json"
    assert json.loads(body)["status"] == "ok"
    assert _call(app, "/readyz")[0].startswith("503")
    health.started()
    assert _call(app, "/readyz")[0] == "200 OK"
    status, _, body = _call(app, "/metrics")
    assert status.startswith("200") and b"gemini_operator_build_info" in body


def test_the_server_answers_probes_and_scrapes() -> None:
    health = Health()
    server, thread = start_metrics_server(0, OperatorMetrics().registry, health,
                                          addr="127.0.0.1")
    base = f"http://127.0.0.1:{server.server_port}"
    try:
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(base + "/healthz", timeout=5)
        assert err.value.code == 503
        health.beat()
        health.started()
        for path in ("/healthz", "/readyz"):
            with urllib.request.urlopen(base + path, timeout=5) as answer:
                assert json.loads(answer.read())["status"] == "ok"
        with urllib.request.urlopen(base + "/metrics", timeout=5) as answer:
            assert b"process_resident_memory_bytes" in answer.read()
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
