"""The real S3 server (Ceph RADOS Gateway, gemini_local.s3) against a real boto3 client."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from boto3.s3.transfer import TransferConfig
from botocore.exceptions import ConnectionError as BotoConnectionError
from botocore.exceptions import ConnectTimeoutError, EndpointConnectionError, ReadTimeoutError

from gemini_local import s3 as s3_local
from gemini_local.s3 import PauseMode, start_s3, stop_s3
from tests.fixtures.s3 import S3Server

pytestmark = [pytest.mark.integration, pytest.mark.s3]

MiB = 1 << 20
PART = 8 * MiB


def _put_multipart(client: Any, bucket: str, key: str, data: bytes) -> None:
    config = TransferConfig(multipart_threshold=PART, multipart_chunksize=PART, max_concurrency=4)
    client.upload_fileobj(_Reader(data), bucket, key, Config=config)


class _Reader:
    """A file-like view of bytes (boto3 wants read(); BytesIO would copy the payload again)."""

    def __init__(self, data: bytes) -> None:
        self._view, self._pos = memoryview(data), 0

    def read(self, size: int = -1) -> bytes:
        end = len(self._view) if size < 0 else self._pos + size
        chunk = bytes(self._view[self._pos:end])
        self._pos += len(chunk)
        return chunk


def _get(client: Any, bucket: str, key: str) -> bytes:
    body: bytes = client.get_object(Bucket=bucket, Key=key)["Body"].read()
    return body


def _keys(client: Any, bucket: str, prefix: str) -> list[str]:
    listing = client.list_objects_v2(Bucket=bucket, Prefix=prefix)
    return sorted(item["Key"] for item in listing.get("Contents", []))


def _pids_mentioning(path: Path) -> list[int]:
    """Processes whose command line mentions `path`, found independently of gemini_local.s3."""
    needle = str(path.resolve()).encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if needle in cmdline and state not in ("Z", "X"):
            found.append(int(entry.name))
    return found


def _wait_for(condition: Any, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


# --- data path on the shared session server ---------------------------------------------------


def test_multipart_object_larger_than_a_part_reads_back_identical(
    s3_server: S3Server, s3_client: Any, s3_prefix: str
) -> None:
    data = os.urandom(5 * PART + 12345)
    key = s3_prefix + "big"
    _put_multipart(s3_client, s3_server.endpoint.bucket, key, data)
    head = s3_client.head_object(Bucket=s3_server.endpoint.bucket, Key=key)
    assert head["ContentLength"] == len(data)
    assert head["ETag"].strip('"').endswith("-6"), "uploaded as 6 parts"
    assert _get(s3_client, s3_server.endpoint.bucket, key) == data


def test_listing_shows_puts_and_deletes_remove_objects(
    s3_server: S3Server, s3_client: Any, s3_prefix: str
) -> None:
    bucket = s3_server.endpoint.bucket
    for name in ("a", "b", "c"):
        s3_client.put_object(Bucket=bucket, Key=s3_prefix + name, Body=name.encode() * 100)
    assert _keys(s3_client, bucket, s3_prefix) == [s3_prefix + n for n in ("a", "b", "c")]
    s3_client.delete_object(Bucket=bucket, Key=s3_prefix + "b")
    assert _keys(s3_client, bucket, s3_prefix) == [s3_prefix + "a", s3_prefix + "c"]
    s3_client.delete_objects(Bucket=bucket, Delete={"Objects": [
        {"Key": s3_prefix + "a"}, {"Key": s3_prefix + "c"}]})
    assert _keys(s3_client, bucket, s3_prefix) == []


def test_concurrent_multipart_uploads_each_read_back_identical(
    s3_server: S3Server, s3_prefix: str
) -> None:
    bucket = s3_server.endpoint.bucket
    payloads = {f"{s3_prefix}rank-{rank}": os.urandom(PART + rank * MiB) for rank in range(6)}

    def upload(key: str) -> None:
        _put_multipart(s3_server.client(), bucket, key, payloads[key])

    with ThreadPoolExecutor(max_workers=len(payloads)) as pool:
        list(pool.map(upload, payloads))
    client = s3_server.client()
    assert _keys(client, bucket, s3_prefix) == sorted(payloads)
    for key, data in payloads.items():
        assert _get(client, bucket, key) == data, key


def test_refusing_pause_fails_requests_fast_and_resume_serves_old_data(
    s3_server: S3Server, s3_prefix: str
) -> None:
    bucket, key = s3_server.endpoint.bucket, s3_prefix + "kept"
    client = s3_server.client(retries={"max_attempts": 1}, connect_timeout=2, read_timeout=5)
    client.put_object(Bucket=bucket, Key=key, Body=b"before the pause")
    s3_server.pause(PauseMode.REFUSE)
    try:
        started = time.monotonic()
        with pytest.raises((EndpointConnectionError, BotoConnectionError)):
            client.get_object(Bucket=bucket, Key=key)
        assert time.monotonic() - started < 2, "a refused connection fails at once"
        assert s3_local.s3_status(s3_server.state_dir)["paused"] == "refuse"
    finally:
        s3_server.resume()
    assert _get(client, bucket, key) == b"before the pause"
    assert s3_local.s3_status(s3_server.state_dir)["paused"] is None


def test_frozen_gateway_times_requests_out_and_resume_serves_again(
    s3_server: S3Server, s3_prefix: str
) -> None:
    bucket, key = s3_server.endpoint.bucket, s3_prefix + "frozen"
    client = s3_server.client(retries={"max_attempts": 1}, connect_timeout=1, read_timeout=1)
    client.put_object(Bucket=bucket, Key=key, Body=b"x")
    s3_server.pause(PauseMode.FREEZE)
    try:
        with pytest.raises((ReadTimeoutError, ConnectTimeoutError)):
            client.put_object(Bucket=bucket, Key=key, Body=b"y")
    finally:
        s3_server.resume()
    # The frozen gateway may still apply the timed-out put once it runs again: either body.
    assert _get(client, bucket, key) in (b"x", b"y")


def test_status_reports_the_endpoint_and_live_pids(s3_server: S3Server) -> None:
    status = s3_local.s3_status(s3_server.state_dir)
    assert status["running"] is True
    assert status["endpoint"] == s3_server.endpoint.to_dict()
    pids = status["pids"]
    assert isinstance(pids, dict) and set(pids) == {"mon", "osd", "rgw"}
    assert set(pids.values()) <= set(_pids_mentioning(s3_server.state_dir))


# --- lifecycle, each on its own server ---------------------------------------------------------


@pytest.mark.long  # the dev tool's own lifecycle, a server each: `./dev long`
def test_second_start_in_the_same_dir_says_it_already_runs(tmp_path: Path) -> None:
    start_s3(tmp_path)
    try:
        with pytest.raises(s3_local.S3AlreadyRunning, match="stop it first"):
            start_s3(tmp_path)
    finally:
        assert stop_s3(tmp_path) is True
    assert _pids_mentioning(tmp_path) == []
    assert stop_s3(tmp_path) is False


def test_start_on_a_busy_port_says_so(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(s3_local.S3PortBusy, match=f"port {port}"):
            start_s3(tmp_path, port=port)
    assert _pids_mentioning(tmp_path) == []


def test_missing_binaries_name_the_packages_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(s3_local.S3BinariesMissing, match="radosgw ceph-mon ceph-osd ceph-common"):
        start_s3(tmp_path)


def test_invalid_bucket_name_is_refused_before_anything_starts(tmp_path: Path) -> None:
    with pytest.raises(s3_local.S3Error, match="lowercase"):
        start_s3(tmp_path, bucket="Not_A_Bucket")
    assert _pids_mentioning(tmp_path) == []


def _start_in_child_then_crash(state_dir: Path, *, with_watchdog: bool) -> None:
    """A separate Python process starts the server and dies by SIGKILL, stopping nothing."""
    owner = "os.getpid()" if with_watchdog else "None"
    code = (
        "import os, signal, pathlib\n"
        "from gemini_local.s3 import start_s3\n"
        f"start_s3(pathlib.Path({str(state_dir)!r}), stop_with_pid={owner})\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    child = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parents[2],
                           capture_output=True, text=True, timeout=120)
    assert child.returncode == -signal.SIGKILL, child.stderr


@pytest.mark.long  # the dev tool's own lifecycle, a server each: `./dev long`
def test_stop_from_another_process_ends_everything_after_the_starter_crashed(
    tmp_path: Path,
) -> None:
    _start_in_child_then_crash(tmp_path, with_watchdog=False)
    assert s3_local.s3_status(tmp_path)["running"] is True
    assert len(_pids_mentioning(tmp_path)) >= 3
    assert stop_s3(tmp_path) is True
    assert _pids_mentioning(tmp_path) == []
    assert s3_local.s3_status(tmp_path)["running"] is False


@pytest.mark.long  # the dev tool's own lifecycle, a server each: `./dev long`
def test_watchdog_stops_the_server_when_its_owner_is_killed(tmp_path: Path) -> None:
    _start_in_child_then_crash(tmp_path, with_watchdog=True)
    assert _wait_for(lambda: _pids_mentioning(tmp_path) == [], 15), _pids_mentioning(tmp_path)
    assert stop_s3(tmp_path) is False
