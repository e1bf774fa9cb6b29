"""Resumable multipart uploads of a shard version (a persist to S3).

The sidecar pins the version it persists in the slot file (gemini.slots: the trainers
skip overwriting it while it is pinned) only while `stage_copy` copies it into the sidecar's
own memory, then releases it: an upload takes as long as S3 allows (tens of seconds per GiB
on a busy link), and a pin held that long would stop the trainers' in-memory checkpoints after
one more version. The cost is one more version of the shard in the sidecar's memory while an
upload runs; without memory for it, the upload reads the pinned slot as before. Either way it
reads a version no one writes, never a live slot. Its parts go `concurrency` at a time. The upload's
key, id, version, sequence number and part size are kept in a small state file on the pod's
memory volume, which outlives a sidecar restart: a restarted sidecar asked to persist the same
version again asks S3 which parts it already has (ListParts) and sends only the others. An
unfinished upload of another version is aborted.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from botocore.exceptions import ClientError

log = logging.getLogger(__name__)

MIN_PART_BYTES = 5 << 20  # S3's least part size (but for the last part)
STAGE_CHUNK_BYTES = 64 << 20  # numpy releases the GIL while it copies each


def stage_copy(data: memoryview) -> memoryview | None:
    """A private copy of `data` (a pinned slot's payload), or None without memory for one."""
    try:
        copy = np.empty(len(data), dtype=np.uint8)
    except MemoryError:
        log.warning("no memory to copy %d bytes aside for their upload: uploading from the "
                    "pinned slot (the trainers skip their snapshots meanwhile)", len(data))
        return None
    source = np.frombuffer(data, dtype=np.uint8)
    for start in range(0, len(data), STAGE_CHUNK_BYTES):
        end = start + STAGE_CHUNK_BYTES
        copy[start:end] = source[start:end]
    return copy.data


class UploadStopped(Exception):
    """The sidecar is stopping: the upload ends after the parts in flight and stays
    resumable (its state file is kept)."""


@dataclass(frozen=True)
class UploadState:
    """What a restarted sidecar needs to resume an upload."""

    key: str
    upload_id: str
    version: int
    seq: int
    part_bytes: int
    length: int

    def save(self, path: Path) -> None:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(asdict(self)))
        os.replace(tmp, path)

    @staticmethod
    def load(path: Path) -> UploadState | None:
        try:
            return UploadState(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            return None


@dataclass(frozen=True)
class Uploaded:
    key: str
    parts: int  # parts of the object
    sent: int  # parts this call sent (the others were in S3 already)


def upload(client: Any, bucket: str, key: str, data: memoryview, metadata: Mapping[str, str],
           state_path: Path, version: int, seq: int, part_bytes: int,
           concurrency: int, progress: Callable[[int], None] = lambda _: None,
           stop: threading.Event | None = None) -> Uploaded:
    """Upload `data` to `key`, resuming an unfinished upload of the same version and slot
    sequence number recorded at `state_path`; `progress` gets the bytes of each part in S3
    (those already there first). Once `stop` is set no new part starts (UploadStopped): a
    stopping sidecar must not wait for the rest of a long upload."""
    part_bytes = max(part_bytes, MIN_PART_BYTES)
    if len(data) <= part_bytes:
        client.put_object(Bucket=bucket, Key=key, Body=bytes(data), Metadata=dict(metadata))
        progress(len(data))
        return Uploaded(key, 1, 1)
    state = _resume(client, bucket, state_path, key, version, seq, len(data))
    done = _parts_in_s3(client, bucket, state) if state is not None else None
    if state is None or done is None:  # nothing to resume (or S3 no longer knows the upload)
        created = client.create_multipart_upload(Bucket=bucket, Key=key, Metadata=dict(metadata))
        state = UploadState(key, created["UploadId"], version, seq, part_bytes, len(data))
        state.save(state_path)
        done = {}
    count = -(-len(data) // state.part_bytes)
    todo = [n for n in range(1, count + 1) if n not in done]
    if done:
        log.info("resuming the upload of version %d: %d of %d parts already in S3",
                 version, len(done), count)
        progress(sum(_part_size(state, len(data), n) for n in done))

    def send(number: int) -> tuple[int, str]:
        if stop is not None and stop.is_set():
            raise UploadStopped(f"the upload of version {version} stopped before part {number}")
        start = (number - 1) * state.part_bytes
        body = bytes(data[start : start + state.part_bytes])
        answer = client.upload_part(Bucket=bucket, Key=key, UploadId=state.upload_id,
                                    PartNumber=number, Body=body)
        progress(len(body))
        return number, str(answer["ETag"])

    done.update(in_daemon_threads(send, todo, concurrency))
    client.complete_multipart_upload(
        Bucket=bucket, Key=key, UploadId=state.upload_id,
        MultipartUpload={"Parts": [{"PartNumber": n, "ETag": done[n]} for n in sorted(done)]})
    state_path.unlink(missing_ok=True)
    return Uploaded(key, count, len(todo))


def in_daemon_threads(send: Callable[[int], tuple[int, str]], numbers: Sequence[int],
                      concurrency: int) -> dict[int, str]:
    """`send` of every number, `concurrency` at a time, on daemon threads: a part whose
    request S3 never answers must not hold the stopping sidecar's exit, as a pool's threads
    would (the interpreter joins those). The first error is raised once the others end."""
    results: dict[int, str] = {}
    errors: list[BaseException] = []
    lock = threading.Lock()
    pending = iter(numbers)

    def work() -> None:
        while True:
            with lock:
                number = None if errors else next(pending, None)
            if number is None:
                return
            try:
                sent, etag = send(number)
            except BaseException as err:  # raised again by the caller
                with lock:
                    errors.append(err)
                return
            with lock:
                results[sent] = etag

    workers = [threading.Thread(target=work, name=f"gemini-s3-part-{i}", daemon=True)
               for i in range(max(1, min(concurrency, len(numbers))))]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    if errors:
        raise errors[0]
    return results


def _resume(client: Any, bucket: str, state_path: Path, key: str, version: int, seq: int,
            length: int) -> UploadState | None:
    """The recorded upload when it is of this very version; else abort it (None)."""
    state = UploadState.load(state_path)
    if state is None:
        return None
    if (state.key, state.version, state.seq, state.length) == (key, version, seq, length):
        return state
    abort(client, bucket, state)
    state_path.unlink(missing_ok=True)
    return None


def _parts_in_s3(client: Any, bucket: str, state: UploadState) -> dict[int, str] | None:
    """Whole parts S3 holds of the upload; None when S3 does not know the upload (it was
    completed or aborted meanwhile)."""
    parts: dict[int, str] = {}
    marker = 0
    while True:
        try:
            page = client.list_parts(Bucket=bucket, Key=state.key, UploadId=state.upload_id,
                                     PartNumberMarker=marker)
        except ClientError as err:
            log.info("upload %s of %s cannot be resumed: %s", state.upload_id, state.key, err)
            return None
        expected = state.part_bytes
        parts.update({int(p["PartNumber"]): str(p["ETag"]) for p in page.get("Parts", [])
                      if int(p["Size"]) == expected or _is_last(state, int(p["PartNumber"]))})
        if not page.get("IsTruncated"):
            return parts
        marker = int(page["NextPartNumberMarker"])


def _part_size(state: UploadState, length: int, number: int) -> int:
    return max(0, min(state.part_bytes, length - (number - 1) * state.part_bytes))


def _is_last(state: UploadState, number: int) -> bool:
    return number == -(-state.length // state.part_bytes)


def abort(client: Any, bucket: str, state: UploadState) -> None:
    try:
        client.abort_multipart_upload(Bucket=bucket, Key=state.key, UploadId=state.upload_id)
    except ClientError as err:  # already completed or aborted: nothing to free
        log.info("aborting upload %s of %s: %s", state.upload_id, state.key, err)
