"""A sidecar told to stop (SIGTERM: its pod is ending) exits within seconds even while an S3
upload's requests hang, against the project's real S3 server (RADOS Gateway) frozen mid-upload.

Seen on the local cluster: every worker pod of a finished job lived 30 s after its trainer
ended, until the kubelet's SIGKILL (sidecar exit code 137), because the event loop's shutdown
and the interpreter waited for the upload's threads, whose 64 MiB parts the gateway did not
answer."""

from __future__ import annotations

import json
import signal
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from gemini_local.s3 import PauseMode
from gemini_sidecar.s3_checkpoints import UPLOAD_STOP_S
from tests.fixtures.s3 import sidecar_s3_env
from tests.integration.sidecar.conftest import (
    TOKEN,
    SidecarProcess,
    free_port,
    make_config,
    payload,
    write_local,
)

pytestmark = [pytest.mark.integration, pytest.mark.s3]
PART = 5 << 20


def _persist(url: str, version: int) -> None:
    """POST /persist without waiting for the upload (wait_seconds 0: it runs on)."""
    request = urllib.request.Request(
        f"{url}/persist", data=json.dumps({"version": version, "wait_seconds": 0}).encode(),
        headers={"Authorization": f"Bearer {TOKEN.decode()}",
                 "Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(request, timeout=10) as answer:
        assert answer.status in (200, 202), answer.status


def test_sigterm_ends_the_sidecar_within_seconds_while_s3_hangs_mid_upload(
        tmp_path: Path, s3_server: Any, s3_prefix: str) -> None:
    cfg = make_config(0, 1, tmp_path, {0: free_port()})
    size = 12 * PART + 5
    write_local(cfg, 3, payload(3, size), capacity=size)
    car = SidecarProcess(cfg, free_port(), sidecar_s3_env(
        s3_server, s3_prefix, GEMINI_S3_PART_BYTES=str(PART), GEMINI_S3_CONCURRENCY="2"))
    try:
        _persist(car.url, 3)
        time.sleep(0.5)  # the upload has begun (a multipart upload of 13 parts)
        s3_server.pause(PauseMode.FREEZE)  # every request in flight now hangs
        try:
            time.sleep(1.0)
            started = time.monotonic()
            car.proc.send_signal(signal.SIGTERM)
            code = car.proc.wait(timeout=UPLOAD_STOP_S + 20)
            took = time.monotonic() - started
        finally:
            s3_server.resume()
    finally:
        if car.proc.poll() is None:
            car.kill()
    assert code == 0, car.proc.stderr.read() if car.proc.stderr else code
    assert took < UPLOAD_STOP_S + 5, f"the sidecar took {took:.1f} s to exit"
