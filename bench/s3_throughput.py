"""S3 multipart throughput of the local RADOS Gateway against loopback TCP, in the same run.

Starts the real server (gemini_local.s3) three times to time start-up, then moves a 256 MiB
object up and down with boto3's multipart transfer, three times each, and compares the medians
with the loopback TCP throughput measured here too (the physical limit of any local server).
Also reports the daemons' resident memory with the object stored. Last line: one JSON object.

    .venv/bin/python bench/s3_throughput.py [--mib 256] [--runs 3]

Ctrl-C or SIGTERM (a timeout) stops it cleanly: what it started is torn down (exit 130/143).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import socket
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import boto3
from boto3.s3.transfer import TransferConfig
from botocore.config import Config
from support.cleanup import Cleanup, cleaning_up

from gemini_local.s3 import S3Endpoint, s3_status, start_s3, stop_s3

MiB = 1 << 20
PART = 16 * MiB
CONCURRENCY = 8
# The reference recipe (CONTROL_PLANE.md) saw ~230 MiB/s multipart upload on loopback, about
# 5% of what one Python TCP stream moves on such a machine.
TARGET_UPLOAD_RATIO = 0.05


def loopback_mib_s(total: int) -> float:
    """Bytes through one TCP connection on 127.0.0.1, sender and receiver in this process."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        received = [0]

        def receive() -> None:
            conn, _ = server.accept()
            buf = bytearray(MiB)
            with conn:
                while n := conn.recv_into(buf):
                    received[0] += n

        thread = threading.Thread(target=receive)
        thread.start()
        chunk = memoryview(os.urandom(MiB))
        started = time.perf_counter()
        with socket.create_connection(("127.0.0.1", port)) as conn:
            for _ in range(total // MiB):
                conn.sendall(chunk)
        thread.join()
        elapsed = time.perf_counter() - started
    assert received[0] == total
    return total / MiB / elapsed


def client_for(endpoint: S3Endpoint) -> Any:
    return boto3.client(
        "s3", endpoint_url=endpoint.url, region_name=endpoint.region,
        aws_access_key_id=endpoint.access_key, aws_secret_access_key=endpoint.secret_key,
        config=Config(s3={"addressing_style": "path"}, max_pool_connections=CONCURRENCY),
    )


def transfer_mib_s(client: Any, endpoint: S3Endpoint, data: bytes, key: str) -> tuple[float, float]:
    """(upload, download) MiB/s of one multipart round trip; checks the bytes came back."""
    config = TransferConfig(multipart_threshold=PART, multipart_chunksize=PART,
                            max_concurrency=CONCURRENCY)
    started = time.perf_counter()
    client.upload_fileobj(io.BytesIO(data), endpoint.bucket, key, Config=config)
    upload = time.perf_counter() - started
    sink = io.BytesIO()
    started = time.perf_counter()
    client.download_fileobj(endpoint.bucket, key, sink, Config=config)
    download = time.perf_counter() - started
    if sink.getbuffer() != data:
        raise SystemExit(f"{key}: downloaded bytes differ from the uploaded ones")
    size = len(data) / MiB
    return size / upload, size / download


def daemons_rss_mib(state_dir: Path) -> float:
    pids = s3_status(state_dir)["pids"]
    assert isinstance(pids, dict)
    total_kib = 0
    for pid in pids.values():
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                total_kib += int(line.split()[1])
    return total_kib / 1024


def startup_seconds(root: Path, runs: int, cleanup: Cleanup) -> list[float]:
    times = []
    for run in range(runs):
        state_dir = root / f"startup-{run}"
        cleanup.at_exit(stop_s3, state_dir)
        started = time.perf_counter()
        start_s3(state_dir)
        times.append(time.perf_counter() - started)
        stop_s3(state_dir)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256, help="object size in MiB")
    parser.add_argument("--runs", type=int, default=3, help="runs per measurement")
    args = parser.parse_args()
    size = args.mib * MiB
    with cleaning_up() as cleanup, tempfile.TemporaryDirectory(prefix="s3-bench-") as tmp:
        root = Path(tmp)
        startups = startup_seconds(root, args.runs, cleanup)
        print(f"start-up s: {[round(t, 2) for t in startups]}", flush=True)
        loopback = [loopback_mib_s(size) for _ in range(args.runs)]
        print(f"loopback TCP MiB/s: {[round(x) for x in loopback]}", flush=True)
        state_dir = root / "server"
        cleanup.at_exit(stop_s3, state_dir)
        endpoint = start_s3(state_dir)
        try:
            client = client_for(endpoint)
            data = os.urandom(size)
            ups, downs, rss = [], [], 0.0
            for run in range(args.runs):
                up, down = transfer_mib_s(client, endpoint, data, f"bench/object-{run}")
                rss = max(rss, daemons_rss_mib(state_dir))
                client.delete_object(Bucket=endpoint.bucket, Key=f"bench/object-{run}")
                ups.append(up)
                downs.append(down)
                print(f"run {run}: upload {up:.0f} MiB/s, download {down:.0f} MiB/s", flush=True)
        finally:
            stop_s3(state_dir)
    loop_mib_s = statistics.median(loopback)
    up_mib_s, down_mib_s = statistics.median(ups), statistics.median(downs)
    print(json.dumps({
        "object_mib": args.mib, "part_mib": PART // MiB, "concurrency": CONCURRENCY,
        "startup_s_median": round(statistics.median(startups), 2),
        "loopback_mib_s": round(loop_mib_s), "upload_mib_s": round(up_mib_s),
        "download_mib_s": round(down_mib_s),
        "download_ratio": round(down_mib_s / loop_mib_s, 4),
        "daemons_rss_mib_max": round(rss),
    }))
    print(json.dumps({
        "metric": "s3_multipart_upload_over_loopback_tcp", "value": round(up_mib_s / loop_mib_s, 4),
        "target": TARGET_UPLOAD_RATIO, "better": "higher", "unit": "ratio",
    }))


if __name__ == "__main__":
    main()
