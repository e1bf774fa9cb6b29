"""S3 persistence of shard versions, with an atomic commit marker and retention.

Layout: every job owns `<prefix>/<namespace>/<job>/<uid>/` (`uid`: the GeminiJob's
metadata.uid), so two jobs of one name (in two namespaces, or deleted and created again)
never share a key. Under it, `step-<v>/rank-<r>.bin` holds each rank's shard, carrying its
CRC-32 and length as metadata (the same CRC-32 the trainer wrote in its slot header), and
`step-<v>/COMMITTED` is written only after every rank's object is verified. The marker names
the job it belongs to (namespace, job, uid, world size): a reader trusts a step only through
a marker that names its own job, so a half-persisted step or another job's step is never
restored, and retention lists and deletes under the job's own directory only.

The legacy layout `<prefix>/<job>/step-<v>/` (before namespace and uid were in the key) is
never listed by a job: it is left as it is, and used only when the user copies one of its
steps into a job's directory (`adopt_legacy`, the `gemini checkpoint adopt-legacy` command).

Uploads are multipart, concurrent and resumable (gemini_sidecar.uploads); downloads are
multipart and concurrent (boto3's TransferConfig). These functions block, the sidecar runs them
in a thread.
"""

from __future__ import annotations

import io
import json
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import boto3
from boto3.s3.transfer import TransferConfig
from botocore.config import Config
from botocore.exceptions import ClientError

from gemini.slots.layout import payload_checksum
from gemini_sidecar import uploads
from gemini_sidecar.config import S3Settings

MARKER = "COMMITTED"
_STEP = re.compile(r"step-(\d+)/$")
_SEGMENT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")  # a DNS name or a UID: no "/"
CRC_KEY = "gemini-crc32"
LENGTH_KEY = "gemini-length"
NO_UID = "no-uid"  # the uid segment when GEMINI_JOB_UID is unset (a sidecar run by hand)


class S3Error(Exception):
    """A persisted checkpoint is missing, incomplete or corrupt; the message says which."""


class ForeignCheckpoint(S3Error):
    """A commit marker names another job (namespace, name or uid) or world size."""


@dataclass(frozen=True)
class JobIdentity:
    """Whose checkpoints these are: the GeminiJob's namespace, name and metadata.uid."""

    namespace: str
    name: str
    uid: str

    def __post_init__(self) -> None:
        for what, value in (("namespace", self.namespace), ("job name", self.name),
                            ("job uid", self.uid)):
            if not _SEGMENT.match(value):
                raise ValueError(f"the {what} {value!r} cannot be an S3 key segment")

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name} (uid {self.uid})"


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


def _under_prefix(s3: S3Store, path: str) -> str:
    return f"{s3.prefix}/{path}" if s3.prefix else path


def job_prefix(s3: S3Store, job: JobIdentity) -> str:
    """The directory of every checkpoint of `job`, and of nothing else."""
    return _under_prefix(s3, f"{job.namespace}/{job.name}/{job.uid}/")


def legacy_prefix(s3: S3Store, name: str) -> str:
    """The directory the legacy layout used for every job called `name`."""
    if not _SEGMENT.match(name):
        raise ValueError(f"the job name {name!r} cannot be an S3 key segment")
    return _under_prefix(s3, f"{name}/")


def step_prefix(s3: S3Store, job: JobIdentity, version: int) -> str:
    return f"{job_prefix(s3, job)}step-{version}/"


def shard_key(s3: S3Store, job: JobIdentity, version: int, rank: int) -> str:
    return f"{step_prefix(s3, job, version)}rank-{rank}.bin"


def _ignore(_: int) -> None:
    """No progress wanted."""


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


def persist_pinned(s3: S3Store, job: JobIdentity, version: int, rank: int, data: memoryview,
                   crc: int, seq: int, state_path: Path,
                   progress: Callable[[int], None] = _ignore,
                   stop: threading.Event | None = None) -> uploads.Uploaded:
    """Upload one rank's shard version, resuming an unfinished upload of the same version
    (gemini_sidecar.uploads); the caller has pinned it in the slot file or copied it aside.
    `progress` is called with the bytes of each part in S3; `stop` ends it early."""
    key = shard_key(s3, job, version, rank)
    meta = {CRC_KEY: f"{crc:08x}", LENGTH_KEY: str(len(data))}
    return uploads.upload(s3.client, s3.bucket, key, data, meta, state_path, version, seq,
                          int(s3.transfer.multipart_chunksize), int(s3.transfer.max_concurrency),
                          progress, stop)


def _head(s3: S3Store, key: str) -> dict[str, Any] | None:
    try:
        return dict(s3.client.head_object(Bucket=s3.bucket, Key=key))
    except ClientError as err:
        if _missing(err):
            return None
        raise


def _missing(err: ClientError) -> bool:
    return err.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound")


def _manifest_at(s3: S3Store, key: str, what: str) -> tuple[int, int]:
    """(length, CRC-32) of the object at `key`; S3Error if missing or inconsistent."""
    head = _head(s3, key)
    if head is None:
        raise S3Error(f"s3://{s3.bucket}/{key} is missing: {what}")
    meta = {k.lower(): v for k, v in head.get("Metadata", {}).items()}
    if CRC_KEY not in meta or LENGTH_KEY not in meta:
        raise S3Error(f"s3://{s3.bucket}/{key} has no {CRC_KEY}/{LENGTH_KEY} metadata")
    length = int(meta[LENGTH_KEY])
    if int(head["ContentLength"]) != length:
        raise S3Error(f"s3://{s3.bucket}/{key} holds {head['ContentLength']} bytes, "
                      f"its metadata says {length}")
    return length, int(meta[CRC_KEY], 16)


def shard_manifest(s3: S3Store, job: JobIdentity, version: int, rank: int) -> tuple[int, int]:
    """(length, CRC-32) of a persisted rank object; S3Error if missing or inconsistent."""
    return _manifest_at(s3, shard_key(s3, job, version, rank),
                        f"rank {rank} did not persist step {version}")


def marker_body(job: JobIdentity, version: int, world_size: int,
                ranks: dict[str, dict[str, int]], **extra: str) -> bytes:
    """A commit marker: whose step this is, and every rank's (bytes, crc32)."""
    return json.dumps({"namespace": job.namespace, "job": job.name, "uid": job.uid,
                       "step": version, "world_size": world_size, "ranks": ranks,
                       **extra}).encode()


def commit_checkpoint(s3: S3Store, job: JobIdentity, version: int, world_size: int) -> str:
    """Verify every rank's object of step `version` and write the commit marker (its key).

    Whoever the caller designates (one rank's sidecar) calls this once all ranks reported
    their upload; it raises S3Error naming the first missing or bad rank.
    """
    ranks = {
        str(rank): dict(zip(("bytes", "crc32"), shard_manifest(s3, job, version, rank),
                            strict=True))
        for rank in range(world_size)
    }
    key = step_prefix(s3, job, version) + MARKER
    s3.client.put_object(Bucket=s3.bucket, Key=key,
                         Body=marker_body(job, version, world_size, ranks))
    return key


def _steps_under(s3: S3Store, base: str) -> list[int]:
    """The step directories directly under `base`, oldest first."""
    steps: list[int] = []
    paginator = s3.client.get_paginator("list_objects_v2")
    for page in paginator.paginate(Bucket=s3.bucket, Prefix=base, Delimiter="/"):
        for entry in page.get("CommonPrefixes", []):
            match = _STEP.search(entry["Prefix"])
            if match:
                steps.append(int(match.group(1)))
    return sorted(steps)


def _marker_at(s3: S3Store, key: str) -> dict[str, Any] | None:
    """The marker's JSON, None when there is none."""
    try:
        body = s3.client.get_object(Bucket=s3.bucket, Key=key)["Body"].read()
    except ClientError as err:
        if _missing(err):
            return None
        raise
    try:
        doc = json.loads(body)
    except ValueError as err:
        raise S3Error(f"s3://{s3.bucket}/{key} is not a commit marker (not JSON)") from err
    if not isinstance(doc, dict):
        raise S3Error(f"s3://{s3.bucket}/{key} is not a commit marker (not an object)")
    return doc


def foreign_reason(marker: dict[str, Any], job: JobIdentity, version: int) -> str | None:
    """Why the marker of step `version` under `job`'s directory is not `job`'s own (None:
    it is). A marker without namespace or uid is a legacy one, copied in by hand."""
    named = (marker.get("namespace"), marker.get("job"), marker.get("uid"))
    if named != (job.namespace, job.name, job.uid):
        return (f"the commit marker of step {version} names job {named[0]}/{named[1]} "
                f"(uid {named[2]}), not {job}")
    if marker.get("step") != version:
        return f"the commit marker of step {version} names step {marker.get('step')}"
    return None


def check_marker(marker: dict[str, Any], job: JobIdentity, version: int,
                 world_size: int) -> None:
    """Raise ForeignCheckpoint unless the marker is `job`'s own, for `world_size` ranks."""
    reason = foreign_reason(marker, job, version)
    if reason is None and marker.get("world_size") != world_size:
        reason = (f"the commit marker of step {version} is for {marker.get('world_size')} "
                  f"ranks, the job has {world_size}")
    if reason is not None:
        raise ForeignCheckpoint(f"refusing to restore another job's checkpoint: {reason}")


def committed_steps(s3: S3Store, job: JobIdentity,
                    refused: dict[int, str] | None = None) -> list[int]:
    """Steps with a commit marker naming `job`, oldest first. A step whose marker names
    another job is left out (and noted in `refused`, step -> why, when given)."""
    steps = []
    for version in _steps_under(s3, job_prefix(s3, job)):
        marker = _marker_at(s3, step_prefix(s3, job, version) + MARKER)
        if marker is None:
            continue
        reason = foreign_reason(marker, job, version)
        if reason is None:
            steps.append(version)
        elif refused is not None:
            refused[version] = reason
    return steps


def latest_committed(s3: S3Store, job: JobIdentity) -> int | None:
    steps = committed_steps(s3, job)
    return steps[-1] if steps else None


def apply_retention(s3: S3Store, job: JobIdentity, keep: int) -> list[int]:
    """Delete all but the newest `keep` committed steps of `job`, and uncommitted steps older
    than the oldest one kept (leftovers of failed persists). Returns the steps deleted. Only
    `job`'s own directory is listed: no other job's objects, nor legacy ones, can go."""
    committed = committed_steps(s3, job)
    kept = committed[-keep:] if keep > 0 else []
    if not kept:
        return []
    doomed = [v for v in _steps_under(s3, job_prefix(s3, job)) if v < kept[0]]
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


def read_marker(s3: S3Store, job: JobIdentity, version: int) -> dict[str, Any]:
    """The commit marker of `job`'s step: {"ranks": {"<r>": {"bytes", "crc32"}}, ...}."""
    key = step_prefix(s3, job, version) + MARKER
    marker = _marker_at(s3, key)
    if marker is None:
        raise S3Error(f"step {version} of job {job} is not committed (no s3://{s3.bucket}/"
                      f"{key})")
    return marker


def download_shard(
    s3: S3Store, job: JobIdentity, version: int, rank: int, dest: memoryview, crc: int,
    progress: Callable[[int], None] = _ignore,
) -> None:
    """Download a rank object into `dest` (its exact length) and verify its CRC-32;
    `progress` is called with the bytes of each piece as it lands."""
    key = shard_key(s3, job, version, rank)
    s3.client.download_fileobj(s3.bucket, key, _ViewWriter(dest), Config=s3.transfer,
                               Callback=progress)
    actual = payload_checksum(dest)
    if actual != crc:
        raise S3Error(f"s3://{s3.bucket}/{key} fails its CRC-32 check ({actual:08x} != "
                      f"{crc:08x}): the object is corrupt")


# -- the legacy layout: read only, and only on the user's explicit request -------------------

def legacy_committed_steps(s3: S3Store, name: str) -> list[int]:
    """Steps with a commit marker in the legacy directory of jobs called `name`."""
    base = legacy_prefix(s3, name)
    return [v for v in _steps_under(s3, base) if _head(s3, f"{base}step-{v}/{MARKER}")]


def adopt_legacy(s3: S3Store, name: str, version: int, job: JobIdentity,
                 world_size: int) -> str:
    """Copy legacy step `version` of jobs called `name` into `job`'s directory, after
    checking its marker (that job name and step, `world_size` ranks) and every rank's
    object against it; the copies are checked again, then `job`'s own marker is written
    (its key), naming where the step came from. Each shard's CRC-32 over its bytes is
    checked when it is restored. Never overwrites a step `job` already has."""
    base = f"{legacy_prefix(s3, name)}step-{version}/"
    marker = _marker_at(s3, base + MARKER)
    if marker is None:
        raise S3Error(f"s3://{s3.bucket}/{base} is not a committed legacy step (no {MARKER})")
    _check_legacy_marker(marker, name, version, world_size)
    if _head(s3, step_prefix(s3, job, version) + MARKER) is not None:
        raise S3Error(f"job {job} already has a committed step {version}; not overwritten")
    ranks: dict[str, dict[str, int]] = {}
    for rank in range(world_size):
        expected = marker["ranks"][str(rank)]
        source = f"{base}rank-{rank}.bin"
        _same_manifest(s3, source, expected, rank)
        _copy(s3, source, shard_key(s3, job, version, rank), expected)
        _same_manifest(s3, shard_key(s3, job, version, rank), expected, rank)
        ranks[str(rank)] = {"bytes": int(expected["bytes"]), "crc32": int(expected["crc32"])}
    key = step_prefix(s3, job, version) + MARKER
    body = marker_body(job, version, world_size, ranks, adopted_from=f"s3://{s3.bucket}/{base}")
    s3.client.put_object(Bucket=s3.bucket, Key=key, Body=body)
    return key


def _check_legacy_marker(marker: dict[str, Any], name: str, version: int,
                         world_size: int) -> None:
    named = (marker.get("job"), marker.get("step"), marker.get("world_size"))
    if named != (name, version, world_size):
        raise ForeignCheckpoint(
            f"the legacy marker names job {named[0]}, step {named[1]}, {named[2]} ranks; "
            f"expected job {name}, step {version}, {world_size} ranks")
    ranks = marker.get("ranks")
    if not isinstance(ranks, dict) or sorted(ranks) != sorted(map(str, range(world_size))):
        raise S3Error(f"the legacy marker of step {version} does not list ranks "
                      f"0..{world_size - 1}")


def _same_manifest(s3: S3Store, key: str, expected: dict[str, Any], rank: int) -> None:
    got = _manifest_at(s3, key, f"rank {rank} of the legacy step")
    if got != (int(expected["bytes"]), int(expected["crc32"])):
        raise S3Error(f"s3://{s3.bucket}/{key} has (bytes, crc32) {got}, its marker says "
                      f"({expected['bytes']}, {expected['crc32']})")


def _copy(s3: S3Store, source: str, dest: str, expected: dict[str, Any]) -> None:
    # A multipart copy does not carry the metadata over by itself: name it again.
    meta = {CRC_KEY: f"{int(expected['crc32']):08x}", LENGTH_KEY: str(int(expected["bytes"]))}
    s3.client.copy({"Bucket": s3.bucket, "Key": source}, s3.bucket, dest,
                   ExtraArgs={"Metadata": meta, "MetadataDirective": "REPLACE"},
                   Config=s3.transfer)
