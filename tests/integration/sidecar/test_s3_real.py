"""Persist to the real S3 server (Ceph RGW), commit, retain, and restore a lost rank from it."""

from __future__ import annotations

import shutil
from typing import Any

import aiohttp
import pytest

from gemini_sidecar.app import Sidecar
from gemini_sidecar.s3 import committed_steps, latest_committed
from tests.fixtures.s3 import sidecar_settings
from tests.integration.sidecar.conftest import (
    TOKEN,
    free_port,
    make_config,
    payload,
    read_local,
    write_local,
)

pytestmark = [pytest.mark.integration, pytest.mark.s3]
AUTH = {"Authorization": f"Bearer {TOKEN.decode()}"}


async def _post(http, car: Sidecar, path: str, body: dict[str, Any]) -> dict[str, Any]:
    url = f"http://127.0.0.1:{car.api_port}{path}"
    async with http.post(url, json=body, headers=AUTH) as resp:
        doc = await resp.json()
        assert resp.status == 200, doc
        return dict(doc)


async def test_persist_commit_retention_and_restore_from_the_real_s3_server(
    tmp_path, s3_server, s3_prefix
):
    s3 = sidecar_settings(s3_server, s3_prefix)
    ports = {0: free_port(), 1: free_port()}
    cars = [Sidecar(make_config(r, 2, tmp_path, ports, s3=s3)) for r in (0, 1)]
    for car in cars:
        await car.start()
    size = (12 << 20) + 16  # multipart
    shards: dict[tuple[int, int], bytes] = {}
    try:
        async with aiohttp.ClientSession() as http:
            for version in (3, 4, 5):
                for rank, car in enumerate(cars):
                    shards[rank, version] = payload(100 * version + rank, size)
                    write_local(car.cfg, version, shards[rank, version], capacity=size)
                    got = await _post(http, car, "/persist", {"version": version})
                    assert got["bytes"] == size
                    if version == 4 and rank == 0 and cars[0].checkpoints.s3 is not None:
                        # a step is invisible until committed
                        saved = cars[0].checkpoints
                        assert latest_committed(saved.s3, saved.identity) == 3
                done = await _post(http, cars[0], "/commit", {"version": version})
                assert done["marker"].endswith(f"step-{version}/COMMITTED")
            assert cars[0].checkpoints.s3 is not None
            saved = cars[0].checkpoints
            assert committed_steps(saved.s3, saved.identity) == [4, 5]  # retain=2

            # rank 1 loses its memory: restore the newest committed step from S3
            await cars[1].stop()
            shutil.rmtree(cars[1].cfg.shm_dir)
            cars[1] = Sidecar(make_config(1, 2, tmp_path, ports, s3=s3))
            await cars[1].start()
            got = await _post(http, cars[1], "/restore", {})
            assert (got["version"], got["bytes"]) == (5, size)
            assert read_local(cars[1].cfg, 5) == shards[1, 5]
    finally:
        for car in cars:
            await car.stop()
