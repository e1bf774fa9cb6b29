"""Checkpoints of different jobs on one bucket never mix (issue 14, item 3), on the real S3
server (Ceph RGW): two jobs of one name in two namespaces and a job created again under its
name (a new uid) persist, retain and restore only their own steps; a step whose marker names
another job is refused; a legacy checkpoint (`<prefix>/<job>/step-<v>/`) is left alone by
retention and restored only after `gemini checkpoint adopt-legacy`."""

from __future__ import annotations

import json
import logging
import shutil
import zlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from gemini.control import paths
from gemini.slots.layout import payload_checksum
from gemini_cli import main as gemini
from gemini_sidecar.app import Sidecar
from gemini_sidecar.config import S3Settings
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
NAME = "train"
SIZE = (6 << 20) + 8  # multipart (5 MiB parts)


@asynccontextmanager
async def job_sidecar(root: Path, s3: S3Settings, namespace: str, uid: str,
                      ) -> AsyncIterator[Sidecar]:
    """The one-rank sidecar of job NAME in `namespace` with `uid`, its own shm directory
    (emptied first: a restarted pod's memory is gone)."""
    shm = root / f"{namespace}-{uid}"
    shutil.rmtree(shm, ignore_errors=True)
    car = Sidecar(make_config(0, 1, shm, {0: free_port()}, job=NAME, s3=s3,
                              namespace=namespace, job_uid=uid))
    await car.start()
    try:
        yield car
    finally:
        await car.stop()


async def _call(http: aiohttp.ClientSession, car: Sidecar, path: str,
                body: dict[str, Any] | None = None) -> tuple[int, dict[str, Any]]:
    url = f"http://127.0.0.1:{car.api_port}{path}"
    request = http.get(url, headers=AUTH) if body is None else http.post(url, json=body,
                                                                         headers=AUTH)
    async with request as resp:
        return resp.status, dict(await resp.json())


async def _ok(http: aiohttp.ClientSession, car: Sidecar, path: str,
              body: dict[str, Any] | None = None) -> dict[str, Any]:
    status, doc = await _call(http, car, path, body)
    assert status == 200, doc
    return doc


async def _checkpoint(http: aiohttp.ClientSession, car: Sidecar, version: int) -> bytes:
    """The trainer writes `version` (its bytes tell the job apart), the operator persists and
    commits it (retention runs with the commit)."""
    data = payload(zlib.crc32(f"{car.cfg.shm_dir}/{version}".encode()), SIZE)
    write_local(car.cfg, version, data, capacity=SIZE)
    await _ok(http, car, paths.PERSIST_PATH, {"version": version})
    await _ok(http, car, paths.COMMIT_PATH, {"version": version})
    return data


async def _steps(http: aiohttp.ClientSession, car: Sidecar) -> list[int]:
    return list((await _ok(http, car, paths.COMMITTED_STEPS_PATH))["steps"])


async def _restored(http: aiohttp.ClientSession, car: Sidecar,
                    version: int | None = None) -> tuple[int, bytes]:
    got = await _ok(http, car, paths.RESTORE_PATH, {"version": version})
    return got["version"], read_local(car.cfg, got["version"])


async def test_same_named_jobs_in_two_namespaces_and_a_recreated_job_keep_apart(
    tmp_path, s3_server, s3_prefix,
):
    s3 = sidecar_settings(s3_server, s3_prefix, retain=1)
    jobs = {"first": ("team-a", "uid-first"), "other namespace": ("team-b", "uid-other"),
            "created again": ("team-a", "uid-again")}
    plan = {"first": (1, 2, 3), "other namespace": (10, 11), "created again": (5,)}
    written: dict[str, dict[int, bytes]] = {job: {} for job in jobs}
    async with aiohttp.ClientSession() as http:
        async with (job_sidecar(tmp_path, s3, *jobs["first"]) as first,
                    job_sidecar(tmp_path, s3, *jobs["other namespace"]) as other,
                    job_sidecar(tmp_path, s3, *jobs["created again"]) as again):
            cars = {"first": first, "other namespace": other, "created again": again}
            for round_ in range(3):  # interleaved: each commit's retention runs among them
                for job, steps in plan.items():
                    if round_ < len(steps):
                        written[job][steps[round_]] = await _checkpoint(http, cars[job],
                                                                        steps[round_])
            assert {job: await _steps(http, car) for job, car in cars.items()} == {
                "first": [3], "other namespace": [11], "created again": [5]}
        for job, (namespace, uid) in jobs.items():  # every pod lost its memory
            async with job_sidecar(tmp_path, s3, namespace, uid) as car:
                version, data = await _restored(http, car)
                newest = plan[job][-1]
                assert version == newest, job
                assert data == written[job][newest], f"{job} restored another job's weights"


async def test_a_step_whose_marker_names_another_job_is_refused_and_logged_once(
    tmp_path, s3_server, s3_prefix, caplog,
):
    s3 = sidecar_settings(s3_server, s3_prefix, retain=2)
    client = s3_server.client()
    async with aiohttp.ClientSession() as http:
        async with job_sidecar(tmp_path, s3, "team-a", "uid-owner") as owner:
            await _checkpoint(http, owner, 4)
        # Someone copies the owner's step (objects and marker) into a job created again.
        source = f"{s3_prefix.strip('/')}/team-a/{NAME}/uid-owner/step-4/"
        target = f"{s3_prefix.strip('/')}/team-a/{NAME}/uid-thief/step-4/"
        for key in ("rank-0.bin", "COMMITTED"):
            client.copy_object(Bucket=s3.bucket, Key=target + key,
                               CopySource={"Bucket": s3.bucket, "Key": source + key})
        caplog.set_level(logging.WARNING, logger="gemini_sidecar.s3_checkpoints")
        async with job_sidecar(tmp_path, s3, "team-a", "uid-thief") as thief:
            assert await _steps(http, thief) == []
            for _ in range(2):
                status, doc = await _call(http, thief, paths.RESTORE_PATH, {"version": 4})
                assert status == 502, doc
                assert doc["error"] == (
                    "S3: refusing to restore another job's checkpoint: the commit marker of "
                    f"step 4 names job team-a/{NAME} (uid uid-owner), not team-a/{NAME} "
                    "(uid uid-thief)")
            status, doc = await _call(http, thief, paths.RESTORE_PATH, {})
            assert status == 400 and "no committed checkpoint" in doc["error"], doc
    refusals = [r for r in caplog.records if "refusing to restore" in r.getMessage()]
    assert len(refusals) == 1, [r.getMessage() for r in caplog.records]
    assert not any(s3.secret_key and s3.secret_key in r.getMessage() for r in caplog.records)


def _legacy_step(client: Any, bucket: str, prefix: str, version: int, data: bytes) -> str:
    """Step `version` of job NAME as the sidecars wrote it before namespace and uid were in
    the key; its directory."""
    base = f"{prefix}/{NAME}/step-{version}/"
    crc = payload_checksum(data)
    client.put_object(Bucket=bucket, Key=base + "rank-0.bin", Body=data,
                      Metadata={"gemini-crc32": f"{crc:08x}", "gemini-length": str(len(data))})
    marker = {"job": NAME, "step": version, "world_size": 1,
              "ranks": {"0": {"bytes": len(data), "crc32": crc}}}
    client.put_object(Bucket=bucket, Key=base + "COMMITTED", Body=json.dumps(marker).encode())
    return base


async def test_a_legacy_checkpoint_is_kept_and_restored_only_once_adopted(
    tmp_path, s3_server, s3_prefix, monkeypatch, capsys,
):
    s3 = sidecar_settings(s3_server, s3_prefix, retain=1)
    client, prefix = s3_server.client(), s3_prefix.strip("/")
    legacy = payload(77, SIZE)
    base = _legacy_step(client, s3.bucket, prefix, 7, legacy)
    async with aiohttp.ClientSession() as http:
        async with job_sidecar(tmp_path, s3, "team-a", "uid-new") as car:
            for version in (1, 2, 3):
                await _checkpoint(http, car, version)
            assert await _steps(http, car) == [3]  # retention ran, among its own steps only
            listed = client.list_objects_v2(Bucket=s3.bucket, Prefix=base)["Contents"]
            assert sorted(o["Key"] for o in listed) == [base + "COMMITTED", base + "rank-0.bin"]
            status, doc = await _call(http, car, paths.RESTORE_PATH, {"version": 7})
            assert status == 502 and "is not committed" in doc["error"], doc
            assert (await _restored(http, car))[0] == 3  # not the legacy step 7

        ep = s3_server.endpoint
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", ep.access_key)
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", ep.secret_key)
        monkeypatch.setenv("AWS_REGION", ep.region)
        adopt = ["checkpoint", "adopt-legacy", "--bucket-uri", f"s3://{ep.bucket}/{prefix}",
                 "--endpoint", ep.url, "--namespace", "team-a", "--job", NAME,
                 "--uid", "uid-new"]
        assert gemini([*adopt, "--world-size", "2"]) == 1  # the legacy step has 1 rank
        assert "expected job train, step 7, 2 ranks" in capsys.readouterr().err
        assert gemini([*adopt, "--world-size", "1"]) == 0
        assert f"{prefix}/team-a/{NAME}/uid-new/step-7/COMMITTED" in capsys.readouterr().out

        async with job_sidecar(tmp_path, s3, "team-a", "uid-new") as car:
            assert await _steps(http, car) == [3, 7]
            assert await _restored(http, car) == (7, legacy)
        async with job_sidecar(tmp_path, s3, "team-b", "uid-other") as stranger:
            assert await _steps(http, stranger) == []  # adopted by one job, not by all
