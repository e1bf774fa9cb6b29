"""`gemini sidecar` processes on loopback, driven through their HTTP API as the operator and
the trainer library would: replication, auth, metrics, a replacement that fetches, placement."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
from typing import Any

import aiohttp
import pytest

from tests.integration.sidecar.conftest import (
    TOKEN,
    SidecarProcess,
    free_port,
    make_config,
    payload,
    read_local,
    write_local,
)

pytestmark = pytest.mark.integration
AUTH = {"Authorization": f"Bearer {TOKEN.decode()}"}
SIZE = 2 * (1 << 20) + 40


async def _json(session, method, url, body=None, headers=AUTH):
    async with session.request(method, url, json=body, headers=headers) as resp:
        return resp.status, await resp.json()


def _spawn(rank: int, tmp_path, ports, hold, send_to) -> SidecarProcess:
    cfg = make_config(rank, 2, tmp_path, ports, hold=hold, send_to=send_to)
    return SidecarProcess(cfg, free_port())


async def test_two_sidecar_processes_replicate_and_a_replacement_fetches_back(tmp_path):
    ports = {0: free_port(), 1: free_port()}
    procs = [_spawn(0, tmp_path, ports, (1,), (1,)), _spawn(1, tmp_path, ports, (0,), (0,))]
    shards = {r: payload(10 + r, SIZE) for r in (0, 1)}
    try:
        async with aiohttp.ClientSession() as http:
            for rank, proc in enumerate(procs):
                info = write_local(proc.cfg, 1, shards[rank])
                status, _ = await _json(http, "POST", proc.url + "/v1/local/committed",
                                        {"rank": rank, "version": 1, "checksum": info.checksum})
                assert status == 202
            inventories: dict[int, dict[str, Any]] = {}

            async def replicated() -> bool:
                for rank, proc in enumerate(procs):
                    inventories[rank] = (await _json(http, "GET", proc.url + "/inventory"))[1]
                return all(any(r["complete"] and r["version"] == 1 for r in inv["replicas"])
                           for inv in inventories.values())

            for _ in range(500):
                if await replicated():
                    break
                await asyncio.sleep(0.02)
            assert await replicated(), inventories
            replica = inventories[1]["replicas"][0]
            assert (replica["rank"], replica["bytes"]) == (0, SIZE)
            assert replica["checksum"] == inventories[0]["local"][0]["checksum"]

            # the API refuses callers without a token; probes and metrics are open
            status, body = await _json(http, "GET", procs[0].url + "/inventory", headers={})
            assert status == 401 and "sign the request" in body["error"]
            status, _ = await _json(http, "GET", procs[0].url + "/healthz", headers={})
            assert status == 200
            async with http.get(procs[0].url + "/metrics") as resp:
                text = await resp.text()
            sent = next(line for line in text.splitlines()
                        if line.startswith('gemini_replication_bytes_total{geminijob="job-a",'
                                        'geminijob_namespace="default",rank="0"}'))
            assert float(sent.rsplit(" ", 1)[1]) == SIZE

            # rank 0 loses its pod: trainer, sidecar and memory
            procs[0].kill()
            shutil.rmtree(procs[0].cfg.shm_dir)
            procs[0] = _spawn(0, tmp_path, ports, (1,), (1,))
            status, got = await _json(http, "POST", procs[0].url + "/fetch",
                                      {"rank": 0, "version": 1, "holders": [1]})
            assert status == 200, got
            assert read_local(procs[0].cfg, 1) == shards[0]
            status, got = await _json(http, "POST", procs[0].url + "/fetch-replicas", {})
            assert status == 200 and got["replicas"][0]["version"] == 1, got
            inv = (await _json(http, "GET", procs[0].url + "/inventory"))[1]
            assert [(r["rank"], r["version"], r["complete"]) for r in inv["replicas"]] == [
                (1, 1, True)]

            # a fetch nobody can serve fails with a clear error, and the sidecar keeps serving
            status, got = await _json(http, "POST", procs[0].url + "/fetch",
                                      {"rank": 0, "version": 99, "holders": [1]})
            assert status == 502 and "could not fetch rank 0 version 99" in got["error"]

            # the operator re-places: rank 0 no longer holds rank 1
            status, got = await _json(http, "POST", procs[0].url + "/peers", {
                "peers": {"1": f"127.0.0.1:{ports[1]}"}, "hold_ranks": [], "send_to": [1]})
            assert status == 200 and got["hold_ranks"] == []
            inv = (await _json(http, "GET", procs[0].url + "/inventory"))[1]
            assert inv["replicas"] == [] and inv["memory"]["used_bytes"] == 0
            status, got = await _json(http, "POST", procs[0].url + "/peers", {"send_to": [5]})
            assert status == 400 and "outside the world" in got["error"]
    finally:
        for proc in procs:
            proc.stop()


def test_a_bad_configuration_exits_with_a_clear_message():
    code = "import sys; from gemini_cli import main; sys.exit(main(['sidecar']))"
    out = subprocess.run([sys.executable, "-c", code], env={"PATH": "/usr/bin"},
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "bad sidecar configuration: GEMINI_JOB is not set" in out.stderr
