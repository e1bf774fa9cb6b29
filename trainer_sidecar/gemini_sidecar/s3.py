"""S3 persistence of shard versions, with an atomic commit marker and retention.

Layout: `<prefix>/<job>/step-<v>/rank-<r>.bin`, each object carrying its CRC-32 and length
as metadata (the same CRC-32 the trainer wrote in its slot header), and
`<prefix>/<job>/step-<v>/COMMITTED`, written only after every rank's object is verified. A
reader trusts a step only through its marker, so a half-persisted step is never restored.
Uploads and downloads are multipart and concurrent (boto3's TransferConfig); these functions
block, the sidecar runs them in a thread.
"""

from __future__ import annotations

import io
import json
import re
from dataclasses import dataclass
from typing import Any

import boto3
from boto3.s3.transfer import TransferConfig
from botocore.config import Config
from botocore.exceptions import ClientError

from gemini_sidecar.config import S3Settings
from gemini_trainer.shm import payload_checksum

MARKER = "COMMITTED"
_STEP = re.compile(r"step-(\d+)/$")
CRC_KEY = "gemini-crc32"
LENGTH_KEY = "gemini-length"


class S3Error(Exception):
    """A persisted checkpoint is missing, incomplete or corrupt; the message says which."""


@dataclass(frozen=True)
class S3Store:
    client: Any  # a boto3 S3 client
    bucket: str
    prefix: str
    transfer: TransferConfig


def open_store(settings: S3Settings) -> S3Store:
    client = boto3.client(
        "s3",
        endpoint_url=settings.endpoint_url,
        region_name=settings.region,
        aws_access_key_id=settings.access_key,
        aws_secret_access_key=settings.secret_key,
        config=Config(
            max_pool_connections=max(10, settings.concurrency * 2),
            retries={"max_attempts": 5, "mode": "standard"},
            s3={"addressing_style": "path"},
        ),
    )
    transfer = TransferConfig(
        multipart_threshold=settings.part_bytes,
        multipart_chunksize=settings.part_bytes,
        max_concurrency=settings.concurrency,
    )
    return S3Store(client, settings.bucket, settings.prefix.strip("/"), transfer)


def step_prefix(s3: S3Store, job: str, version: int) -> str:
    return f"{s3.prefix}/{job}/step-{version}/" if s3.prefix else f"{job}/step-{version}/"


def shard_key(s3: S3Store, job: str, version: int, rank: int) -> str:
    return f"{step_prefix(s3, job, version)}rank-{rank}.bin"


class _ViewFile(io.RawIOBase):
    """A seekable file over a memoryview, so transfers need no copy of the shard first."""

    def __init__(self, view: memoryview) -> None:
        self._view = view.cast("B")
        self._pos = 0

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._view)}[whence]
        self._pos = max(0, base + offset)
        return self._pos


class _ViewReader(_ViewFile):
    """Uploads read the shard straight from its memory."""

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        out = memoryview(buffer).cast("B")
        n = max(0, min(len(out), len(self._view) - self._pos))
        out[:n] = self._view[self._pos : self._pos + n]
        self._pos += n
        return n


class _ViewWriter(_ViewFile):
    """Downloads write into preallocated memory (concurrent parts seek, then write)."""

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        src = memoryview(data).cast("B")
        if self._pos + len(src) > len(self._view):
            raise S3Error(f"object larger than expected ({self._pos + len(src)} bytes)")
        self._view[self._pos : self._pos + len(src)] = src
        self._pos += len(src)
        return len(src)


def persist_shard(
    s3: S3Store, job: str, version: int, rank: int, data: memoryview, crc: int
) -> str:
    """Upload one rank's shard version (multipart, concurrent); returns its key."""
    key = shard_key(s3, job, version, rank)
    meta = {CRC_KEY: f"{crc:08x}", LENGTH_KEY: str(len(data))}
    s3.client.upload_fileobj(
        _ViewReader(data), s3.bucket, key, ExtraArgs={"Metadata": meta}, Config=s3.transfer
    )
    return key


def _head(s3: S3Store, key: str) -> dict[str, Any] | None:
    try:
        return dict(s3.client.head_object(Bucket=s3.bucket, Key=key))
    except ClientError as err:
        if err.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
            return None
        raise


def shard_manifest(s3: S3Store, job: str, version: int, rank: int) -> tuple[int, int]:
    """(length, CRC-32) of a persisted rank object; S3Error if missing or inconsistent."""
    key = shard_key(s3, job, version, rank)
    head = _head(s3, key)
    if head is None:
        raise S3Error(f"s3://{s3.bucket}/{key} is missing: rank {rank} did not persist step "
                      f"{version}")
    meta = {k.lower(): v for k, v in head.get("Metadata", {}).items()}
    if CRC_KEY not in meta or LENGTH_KEY not in meta:
        raise S3Error(f"s3://{s3.bucket}/{key} has no {CRC_KEY}/{LENGTH_KEY} metadata")
    length = int(meta[LENGTH_KEY])
    if int(head["ContentLength"]) != length:
        raise S3Error(f"s3://{s3.bucket}/{key} holds {head['ContentLength']} bytes, "
                      f"its metadata says {length}")
    return length, int(meta[CRC_KEY], 16)


def commit_checkpoint(s3: S3Store, job: str, version: int, world_size: int) -> str:
    """Verify every rank's object of step `version` and write the commit marker (its key).

    Whoever the caller designates (one rank's sidecar, or the operator) calls this once all
    ranks reported their upload; it raises S3Error naming the first missing or bad rank.
    """
    ranks = {
        str(rank): dict(zip(("bytes", "crc32"), shard_manifest(s3, job, version, rank),
                            strict=True))
        for rank in range(world_size)
    }
    body = json.dumps({"job": job, "step": version, "world_size": world_size, "ranks": ranks})
    key = step_prefix(s3, job, version) + MARKER
    s3.client.put_object(Bucket=s3.bucket, Key=key, Body=body.encode())
    return key


def _steps(s3: S3Store, job: str) -> list[int]:
    base = f"{s3.prefix}/{job}/" if s3.prefix else f"{job}/"
    steps: list[int] = []
    paginator = s3.client.get_paginator("list_objects_v2")
    for page in paginator.paginate(Bucket=s3.bucket, Prefix=base, Delimiter="/"):
        for entry in page.get("CommonPrefixes", []):
            match = _STEP.search(entry["Prefix"])
            if match:
                steps.append(int(match.group(1)))
    return sorted(steps)


def committed_steps(s3: S3Store, job: str) -> list[int]:
    """Steps with a commit marker, oldest first."""
    return [v for v in _steps(s3, job) if _head(s3, step_prefix(s3, job, v) + MARKER)]


def latest_committed(s3: S3Store, job: str) -> int | None:
    steps = committed_steps(s3, job)
    return steps[-1] if steps else None


def apply_retention(s3: S3Store, job: str, keep: int) -> list[int]:
    """Delete all but the newest `keep` committed steps, and uncommitted steps older than the
    oldest one kept (leftovers of failed persists). Returns the steps deleted."""
    committed = committed_steps(s3, job)
    kept = committed[-keep:] if keep > 0 else []
    if not kept:
        return []
    doomed = [v for v in _steps(s3, job) if v < kept[0]]
    for version in doomed:
        # The marker goes first, so a step being deleted stops counting as committed at once.
        s3.client.delete_object(Bucket=s3.bucket, Key=step_prefix(s3, job, version) + MARKER)
        _delete_prefix(s3, step_prefix(s3, job, version))
    return doomed


def _delete_prefix(s3: S3Store, prefix: str) -> None:
    paginator = s3.client.get_paginator("list_objects_v2")
    for page in paginator.paginate(Bucket=s3.bucket, Prefix=prefix):
        keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
        for i in range(0, len(keys), 1000):
            s3.client.delete_objects(Bucket=s3.bucket, Delete={"Objects": keys[i : i + 1000]})


def read_marker(s3: S3Store, job: str, version: int) -> dict[str, Any]:
    """The commit marker of a step: {"ranks": {"<r>": {"bytes", "crc32"}}, ...}."""
    key = step_prefix(s3, job, version) + MARKER
    try:
        body = s3.client.get_object(Bucket=s3.bucket, Key=key)["Body"].read()
    except ClientError as err:
        raise S3Error(f"step {version} of job {job} is not committed (no s3://{s3.bucket}/"
                      f"{key})") from err
    return dict(json.loads(body))


def download_shard(
    s3: S3Store, job: str, version: int, rank: int, dest: memoryview, crc: int
) -> None:
    """Download a rank object into `dest` (its exact length) and verify its CRC-32."""
    key = shard_key(s3, job, version, rank)
    s3.client.download_fileobj(s3.bucket, key, _ViewWriter(dest), Config=s3.transfer)
    actual = payload_checksum(dest)
    if actual != crc:
        raise S3Error(f"s3://{s3.bucket}/{key} fails its CRC-32 check ({actual:08x} != "
                      f"{crc:08x}): the object is corrupt")
