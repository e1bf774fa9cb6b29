"""S3 persistence against moto's server: upload, commit marker, retention, verified download."""

from __future__ import annotations

import os
from collections.abc import Iterator

import boto3
import pytest
from moto.server import ThreadedMotoServer

from gemini_sidecar.config import S3Settings
from gemini_sidecar.s3 import (
    S3Error,
    S3Store,
    apply_retention,
    commit_checkpoint,
    committed_steps,
    download_shard,
    latest_committed,
    open_store,
    persist_shard,
    read_marker,
    shard_key,
)
from gemini_trainer.shm import payload_checksum

JOB = "job-s3"


@pytest.fixture(scope="module")
def moto_url() -> Iterator[str]:
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()


@pytest.fixture
def store(moto_url: str, request: pytest.FixtureRequest) -> S3Store:
    bucket = f"b-{abs(hash(request.node.name)) % 10**8}"
    settings = S3Settings(bucket=bucket, prefix="ckpt", endpoint_url=moto_url,
                          access_key="k", secret_key="s", part_bytes=5 << 20, concurrency=4)
    boto3.client("s3", endpoint_url=moto_url, region_name="us-east-1", aws_access_key_id="k",
                 aws_secret_access_key="s").create_bucket(Bucket=bucket)
    return open_store(settings)


def _persist_step(store: S3Store, version: int, world: int, size: int) -> list[bytes]:
    shards = [os.urandom(size) for _ in range(world)]
    for rank, data in enumerate(shards):
        persist_shard(store, JOB, version, rank, memoryview(data), payload_checksum(data))
    return shards


def test_a_step_is_committed_only_when_every_rank_is_in_place(store):
    shards = [os.urandom(12 << 20), os.urandom(1000)]  # multipart and single-part
    persist_shard(store, JOB, 4, 0, memoryview(shards[0]), payload_checksum(shards[0]))
    with pytest.raises(S3Error, match="rank 1 did not persist step 4"):
        commit_checkpoint(store, JOB, 4, 2)
    assert latest_committed(store, JOB) is None
    persist_shard(store, JOB, 4, 1, memoryview(shards[1]), payload_checksum(shards[1]))
    key = commit_checkpoint(store, JOB, 4, 2)
    assert key == "ckpt/job-s3/step-4/COMMITTED"
    assert latest_committed(store, JOB) == 4
    marker = read_marker(store, JOB, 4)
    assert marker["ranks"]["0"] == {"bytes": len(shards[0]), "crc32": payload_checksum(shards[0])}
    dest = bytearray(len(shards[0]))
    download_shard(store, JOB, 4, 0, memoryview(dest), marker["ranks"]["0"]["crc32"])
    assert bytes(dest) == shards[0]


def test_a_corrupt_object_fails_its_download_check(store):
    data = os.urandom(4096)
    persist_shard(store, JOB, 1, 0, memoryview(data), payload_checksum(data) ^ 1)
    with pytest.raises(S3Error, match="fails its CRC-32 check"):
        download_shard(store, JOB, 1, 0, memoryview(bytearray(4096)), payload_checksum(data) ^ 1)


def test_retention_keeps_the_last_k_committed_steps_and_drops_older_leftovers(store):
    for version in (1, 2, 3, 5):
        _persist_step(store, version, 2, 100)
        commit_checkpoint(store, JOB, version, 2)
    _persist_step(store, 0, 1, 100)  # rank 1 never persisted step 0: a leftover
    _persist_step(store, 4, 1, 100)  # step 4 not committed (yet?): newer than what is kept
    deleted = apply_retention(store, JOB, keep=2)
    assert deleted == [0, 1, 2]
    assert committed_steps(store, JOB) == [3, 5]
    keys = {o["Key"] for o in store.client.list_objects_v2(Bucket=store.bucket)["Contents"]}
    assert shard_key(store, JOB, 1, 0) not in keys and shard_key(store, JOB, 3, 1) in keys
    assert shard_key(store, JOB, 4, 0) in keys
