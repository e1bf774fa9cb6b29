"""The operator's /healthz and /readyz (the probes' endpoints), served beside /metrics and on
a port of their own."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request

import pytest

from gemini_operator.runtime.health import Health, start_metrics_server
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


def _get(url: str) -> tuple[int, dict[str, str], bytes]:
    try:
        with urllib.request.urlopen(url, timeout=5) as answer:
            return answer.status, dict(answer.headers), answer.read()
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), err.read()


def test_the_servers_answer_probes_on_both_ports_and_scrapes_on_the_metrics_port() -> None:
    health = Health()
    server = start_metrics_server(0, OperatorMetrics().registry, health, addr="127.0.0.1",
                                  probe_port=0)
    metrics = f"http://127.0.0.1:{server.port}"
    probes = f"http://127.0.0.1:{server.probe_port}"
    try:
        for base in (metrics, probes):
            status, _, body = _get(base + "/healthz")
            assert status == 503 and json.loads(body)["status"] == "failing"
        health.beat()
        for base in (metrics, probes):
            status, headers, body = _get(base + "/healthz")
            assert status == 200 and headers["Content-Type"].startswith("application/json")
            assert json.loads(body)["status"] == "ok"
            assert _get(base + "/readyz")[0] == 503
        health.started()
        for base in (metrics, probes):
            assert _get(base + "/readyz")[0] == 200
        status, headers, body = _get(metrics + "/metrics")
        assert status == 200 and b"process_resident_memory_bytes" in body
        assert b"gemini_operator_build_info" in body
        assert _get(probes + "/metrics")[0] == 404  # the probes' port serves nothing else
    finally:
        server.stop()
