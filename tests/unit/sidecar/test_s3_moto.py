"""S3 persistence against moto's server: upload, commit marker, retention, verified download."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import boto3
import pytest
from moto.server import ThreadedMotoServer

from gemini.slots.layout import payload_checksum
from gemini_sidecar.config import S3Settings
from gemini_sidecar.s3 import (
    ForeignCheckpoint,
    JobIdentity,
    S3Error,
    S3Store,
    adopt_legacy,
    apply_retention,
    check_marker,
    commit_checkpoint,
    committed_steps,
    download_shard,
    latest_committed,
    open_store,
    persist_pinned,
    read_marker,
    shard_key,
)


def persist_shard(store: S3Store, job: JobIdentity, version: int, rank: int, data: memoryview,
                  crc: int) -> None:
    """What the sidecar's persist does, without the pin (no slot file here)."""
    with tempfile.TemporaryDirectory() as tmp:
        persist_pinned(store, job, version, rank, data, crc, seq=1,
                       state_path=Path(tmp) / "upload.json")


JOB = JobIdentity("team-a", "job-s3", "0b8f6c1e-1111-4a2b-9c3d-000000000001")


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
    assert key == f"ckpt/team-a/job-s3/{JOB.uid}/step-4/COMMITTED"
    assert latest_committed(store, JOB) == 4
    marker = read_marker(store, JOB, 4)
    assert (marker["namespace"], marker["job"], marker["uid"], marker["world_size"]) == (
        "team-a", "job-s3", JOB.uid, 2)
    check_marker(marker, JOB, 4, 2)
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


def _same_name(namespace: str = JOB.namespace, uid: str = JOB.uid) -> JobIdentity:
    return JobIdentity(namespace, JOB.name, uid)


def test_jobs_of_one_name_in_two_namespaces_or_two_lives_keep_apart(store):
    other_namespace, recreated = _same_name(namespace="team-b"), _same_name(uid="new-uid")
    for job, steps in ((JOB, (1, 2, 3)), (other_namespace, (10, 11)), (recreated, (20,))):
        for version in steps:
            data = os.urandom(100)
            persist_shard(store, job, version, 0, memoryview(data), payload_checksum(data))
            commit_checkpoint(store, job, version, 1)
    assert apply_retention(store, JOB, keep=1) == [1, 2]
    assert apply_retention(store, recreated, keep=1) == []
    assert committed_steps(store, JOB) == [3]
    assert committed_steps(store, other_namespace) == [10, 11]
    assert committed_steps(store, recreated) == [20]


def test_a_marker_naming_another_job_is_neither_listed_nor_restored(store):
    data = os.urandom(100)
    persist_shard(store, JOB, 5, 0, memoryview(data), payload_checksum(data))
    commit_checkpoint(store, JOB, 5, 1)
    theirs = store.client.get_object(Bucket=store.bucket, Key=f"ckpt/team-a/job-s3/{JOB.uid}/"
                                     "step-5/COMMITTED")["Body"].read()
    mine = _same_name(uid="another-uid")
    persist_shard(store, mine, 5, 0, memoryview(data), payload_checksum(data))
    store.client.put_object(Bucket=store.bucket, Key="ckpt/team-a/job-s3/another-uid/step-5/"
                            "COMMITTED", Body=theirs)  # copied over by hand
    refused: dict[int, str] = {}
    assert committed_steps(store, mine, refused) == []
    assert "names job team-a/job-s3 (uid " + JOB.uid in refused[5]
    with pytest.raises(ForeignCheckpoint, match="refusing to restore another job's checkpoint"):
        check_marker(read_marker(store, mine, 5), mine, 5, 1)
    with pytest.raises(ForeignCheckpoint, match="is for 1 ranks, the job has 2"):
        check_marker(read_marker(store, JOB, 5), JOB, 5, 2)


def _legacy_step(store: S3Store, name: str, version: int, shards: list[bytes]) -> None:
    """What the sidecars wrote before namespace and uid were in the key."""
    base = f"ckpt/{name}/step-{version}/"
    ranks = {}
    for rank, data in enumerate(shards):
        crc = payload_checksum(data)
        store.client.put_object(Bucket=store.bucket, Key=f"{base}rank-{rank}.bin", Body=data,
                                Metadata={"gemini-crc32": f"{crc:08x}",
                                          "gemini-length": str(len(data))})
        ranks[str(rank)] = {"bytes": len(data), "crc32": crc}
    marker = {"job": name, "step": version, "world_size": len(shards), "ranks": ranks}
    store.client.put_object(Bucket=store.bucket, Key=f"{base}COMMITTED",
                            Body=json.dumps(marker).encode())


def test_a_legacy_step_is_left_alone_until_adopted_and_checked(store):
    shards = [os.urandom(6 << 20), os.urandom(300)]  # a multipart copy and a single one
    _legacy_step(store, JOB.name, 2, shards)
    for version in (3, 4):
        _persist_step(store, version, 2, 100)
        commit_checkpoint(store, JOB, version, 2)
        apply_retention(store, JOB, keep=1)
    assert committed_steps(store, JOB) == [4]
    legacy = {o["Key"] for o in store.client.list_objects_v2(
        Bucket=store.bucket, Prefix="ckpt/job-s3/step-2/")["Contents"]}
    assert len(legacy) == 3  # retention of the new layout never touches it
    with pytest.raises(ForeignCheckpoint, match="3 ranks"):
        adopt_legacy(store, JOB.name, 2, JOB, 3)
    adopt_legacy(store, JOB.name, 2, JOB, 2)
    assert committed_steps(store, JOB) == [2, 4]
    marker = read_marker(store, JOB, 2)
    check_marker(marker, JOB, 2, 2)
    assert marker["adopted_from"] == f"s3://{store.bucket}/ckpt/job-s3/step-2/"
    dest = bytearray(len(shards[0]))
    download_shard(store, JOB, 2, 0, memoryview(dest), marker["ranks"]["0"]["crc32"])
    assert bytes(dest) == shards[0]
    with pytest.raises(S3Error, match="already has a committed step 2"):
        adopt_legacy(store, JOB.name, 2, JOB, 2)
