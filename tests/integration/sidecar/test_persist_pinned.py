"""Persists read a version copied aside under a pin and resume after a sidecar restart
(gemini_sidecar.uploads), against the real S3 server the project starts (Ceph RADOS Gateway)."""

from __future__ import annotations

import asyncio
import threading
import time
import zlib
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from gemini.slots.layout import shard_path
from gemini.slots.shard import ShardSlots
from gemini_sidecar import uploads
from gemini_sidecar.app import Sidecar
from gemini_sidecar.config import S3Settings
from gemini_sidecar.local import LocalShardError
from gemini_sidecar.s3 import open_store
from tests.fixtures.s3 import sidecar_settings
from tests.integration.sidecar.conftest import (
    TOKEN,
    free_port,
    make_config,
    payload,
    wait_for,
    write_local,
)

pytestmark = [pytest.mark.integration, pytest.mark.s3]
PART = 5 << 20


def settings(s3_server: Any, prefix: str) -> S3Settings:
    return sidecar_settings(s3_server, prefix, part_bytes=PART, concurrency=2)


async def test_a_persist_pins_its_version_only_to_copy_it_so_checkpoints_go_on_during_upload(
        tmp_path: Path, s3_server: Any, s3_prefix: str) -> None:
    car = Sidecar(make_config(0, 1, tmp_path, {0: free_port()}, s3=settings(s3_server, s3_prefix)))
    await car.start()
    assert car.checkpoints.s3 is not None
    slow = SlowParts(car.checkpoints.s3.client, delay=0.3)  # 10 parts, 2 at a time: about 1.5 s
    car.checkpoints.s3 = replace(car.checkpoints.s3, client=slow)
    size = 9 * PART + 123
    info = write_local(car.cfg, 7, payload(7, size), capacity=size)
    path = shard_path(0, car.cfg.shm_dir, car.cfg.job)
    pins: list[int] = []
    stop = threading.Event()

    def watch() -> None:
        with ShardSlots(path) as slots:
            while not stop.is_set():
                pins.append(slots.pinned_seq)
                time.sleep(0.0002)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        async with aiohttp.ClientSession() as http:
            persist = asyncio.create_task(http.post(
                f"http://127.0.0.1:{car.api_port}/persist", json={"version": 7},
                headers={"Authorization": f"Bearer {TOKEN.decode()}"}))
            await wait_for(lambda: slow.started > 0, what="the upload's first part")
            # The trainer's two next snapshots, while the upload runs: both slots are free.
            for version in (8, 9):
                with ShardSlots(path) as slots:
                    newest = slots.latest_complete()
                    assert newest is not None
                    assert slots.may_overwrite(acknowledged_seq=newest.seq), \
                        f"version {version} would be skipped: the upload still pins its slot"
                write_local(car.cfg, version, payload(version, size), capacity=size)
            assert not persist.done(), "the upload ended before the test wrote into its slot"
            async with await persist as resp:
                assert resp.status == 200, await resp.text()
                key = (await resp.json())["key"]
            # Asked again once its slot is reused (another rank's upload ended much later):
            # answered from the upload, not refused for a version no longer in memory.
            assert (await car.checkpoints.persist(7)).key == key
            car.notify(6, None)  # a restart from an older step: version 7 will be rewritten
            with pytest.raises(LocalShardError):
                await car.checkpoints.persist(7)
    finally:
        stop.set()
        watcher.join()
        await car.stop()
    assert info.seq in pins, "the version was not pinned while it was copied"
    with ShardSlots(path) as slots:
        assert slots.pinned_seq == 0
        assert {i.version for i in slots.slot_info() if i.complete} == {8, 9}
    store = car.checkpoints.s3
    body = store.client.get_object(Bucket=store.bucket, Key=key)["Body"].read()
    assert body == payload(7, size)  # the version asked for, though its slot was reused


async def test_a_stopping_sidecar_ends_its_upload_after_the_parts_in_flight(
        tmp_path: Path, s3_server: Any, s3_prefix: str) -> None:
    # A pod's sidecar got SIGTERM during a long upload and lived on until SIGKILL (30 s):
    # the event loop's shutdown waits for the upload's thread.
    config = make_config(0, 1, tmp_path, {0: free_port()}, s3=settings(s3_server, s3_prefix))
    car = Sidecar(config)
    await car.start()
    assert car.checkpoints.s3 is not None
    slow = SlowParts(car.checkpoints.s3.client, delay=0.5)  # 10 parts, 2 at a time: about 2.5 s
    car.checkpoints.s3 = replace(car.checkpoints.s3, client=slow)
    size = 9 * PART + 123
    write_local(car.cfg, 7, payload(7, size), capacity=size)
    persist = asyncio.create_task(car.checkpoints.persist(7))
    await wait_for(lambda: slow.started > 0, what="the upload's first part")
    started = time.monotonic()
    await car.stop()
    stopped_in = time.monotonic() - started
    parts_at_stop = slow.started
    await asyncio.sleep(1.5)
    assert slow.started == parts_at_stop < 10, "parts were still sent after the stop"
    assert stopped_in < 2.0, f"the stop waited {stopped_in:.1f} s"
    with pytest.raises(uploads.UploadStopped):
        await persist
    # Resumable: a sidecar started again on the pod's memory sends only the parts S3 lacks.
    again = Sidecar(config)
    await again.start()
    assert again.checkpoints.s3 is not None
    counted = SlowParts(again.checkpoints.s3.client, delay=0)
    again.checkpoints.s3 = replace(again.checkpoints.s3, client=counted)
    try:
        answer = await again.checkpoints.persist(7)
    finally:
        await again.stop()
    assert counted.started == 10 - parts_at_stop
    store = again.checkpoints.s3
    body = store.client.get_object(Bucket=store.bucket, Key=answer.key)["Body"].read()
    assert body == payload(7, size)


class SlowParts:
    """A real S3 client whose parts take `delay` seconds each, as on a busy link."""

    def __init__(self, client: Any, delay: float) -> None:
        self._client, self._delay = client, delay
        self.started = 0

    def upload_part(self, **kw: Any) -> Any:
        self.started += 1
        time.sleep(self._delay)
        return self._client.upload_part(**kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


class DiesAfter:
    """A real S3 client that stops working after `parts` uploaded parts, as a sidecar killed
    mid-upload would."""

    def __init__(self, client: Any, parts: int) -> None:
        self._client, self._left = client, parts
        self._lock = threading.Lock()

    def upload_part(self, **kw: Any) -> Any:
        with self._lock:
            if self._left <= 0:
                raise ConnectionError("the sidecar was killed")
            self._left -= 1
        return self._client.upload_part(**kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


def test_a_restarted_upload_sends_only_the_parts_s3_lacks(
        tmp_path: Path, s3_server: Any, s3_prefix: str) -> None:
    store = open_store(settings(s3_server, s3_prefix))
    data = memoryview(payload(3, 7 * PART + 99))
    state = tmp_path / "upload.json"
    key = f"{s3_prefix.strip('/')}/resume/rank-0.bin"
    args = (store.bucket, key, data, {"gemini-crc32": "0"}, state, 3, 11, PART, 1)
    with pytest.raises(ConnectionError):
        uploads.upload(DiesAfter(store.client, 3), *args)
    assert uploads.UploadState.load(state) is not None  # the upload is remembered
    done = uploads.upload(store.client, *args)
    assert (done.parts, done.sent) == (8, 5)  # the three parts in S3 were not sent again
    assert not state.exists()
    body = store.client.get_object(Bucket=store.bucket, Key=key)["Body"].read()
    assert zlib.crc32(body) == zlib.crc32(data)


def test_an_unfinished_upload_of_another_version_is_aborted_and_started_over(
        tmp_path: Path, s3_server: Any, s3_prefix: str) -> None:
    store = open_store(settings(s3_server, s3_prefix))
    state = tmp_path / "upload.json"
    key = f"{s3_prefix.strip('/')}/other/rank-0.bin"
    old = memoryview(payload(4, 3 * PART + 1))
    with pytest.raises(ConnectionError):
        uploads.upload(DiesAfter(store.client, 1), store.bucket, key, old, {}, state, 4, 20,
                       PART, 1)
    stale = uploads.UploadState.load(state)
    assert stale is not None
    new = memoryview(payload(5, 3 * PART + 1))
    done = uploads.upload(store.client, store.bucket, key, new, {}, state, 5, 21, PART, 1)
    assert done.sent == done.parts == 4
    body = store.client.get_object(Bucket=store.bucket, Key=key)["Body"].read()
    assert body == bytes(new)
    uploads_left = store.client.list_multipart_uploads(Bucket=store.bucket).get("Uploads", [])
    assert stale.upload_id not in {u["UploadId"] for u in uploads_left}
