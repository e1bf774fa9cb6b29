"""Restore of a 1 GiB shard from local memory, from a peer and from S3, side by side.

Each path ends the same way: the version verified (CRC-32) and copied into the trainer's
preallocated buffer. Local: the trainer reads its own shared-memory slot. Peer: a replacement
sidecar process (fresh, empty memory) fetches the shard from the holder's replica over
loopback into its shared memory (POST /fetch), then the trainer reads it. S3: the replacement
downloads the committed step from the S3 server (Ceph RGW, started here when installed;
POST /restore), then the trainer reads it. Baselines from the same run: a plain memory copy of
the same bytes into a preallocated buffer, and raw Python TCP between two processes.
The figure: peer restore time over (raw TCP transfer + local restore), i.e. what the peer
path costs beyond moving the bytes over a bare socket and restoring them as from local
memory (both end in the same verified read). Medians of BENCH_RUNS (default 3).
Ctrl-C or SIGTERM (a timeout) stops it cleanly: what it started is torn down (exit 130/143).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from replication_throughput import raw_run
from support.cleanup import Cleanup, cleaning_up
from support.sidecar_procs import (
    SidecarProc,
    commit_version,
    free_port,
    local_s3_env,
    pattern,
    wait_until,
)

from gemini.slots.shard import ShardSlots

SIZE = int(os.environ.get("BENCH_BYTES", str(1 << 30)))
RUNS = int(os.environ.get("BENCH_RUNS", "3"))
VERSION = 1


def trainer_read(slots: ShardSlots, out: np.ndarray) -> None:
    """What restore() does with a version in shm: verify its CRC and copy it out."""
    view = slots.read(VERSION, verify=True)
    out[:] = np.frombuffer(view, dtype=np.uint8)
    view.release()


def start_s3_if_installed(state: Path, cleanup: Cleanup) -> dict[str, str] | None:
    if not shutil.which("radosgw"):
        print("radosgw not installed: S3 path skipped", flush=True)
        return None
    return local_s3_env(state, cleanup, "bench-restore")


def forget(slots: ShardSlots) -> None:
    """Write two small versions over both slots: the version restored is gone, so the next
    run's request moves it again (a finished transfer answers a repeat while its result is
    still in memory: gemini_sidecar.transfers)."""
    for version in (VERSION + 1000, VERSION + 1001):
        commit_version(slots, version, np.zeros(4096, dtype=np.uint8))


def timed(work) -> float:
    start = time.perf_counter()
    work()
    return time.perf_counter() - start


def main() -> None:
    # the sidecars are stopped, and the S3 server, also when interrupted or failing to start
    with cleaning_up() as cleanup:
        measure(cleanup)


def measure(cleanup: Cleanup) -> None:
    root = Path(tempfile.mkdtemp(prefix="gemini-restore-", dir="/dev/shm"))
    cleanup.at_exit(shutil.rmtree, root, True)
    s3_state = Path(tempfile.mkdtemp(prefix="gemini-restore-s3-"))
    s3_env = start_s3_if_installed(s3_state, cleanup)
    ports = {0: free_port(), 1: free_port()}
    owner = SidecarProc(0, 2, root / "owner", ports, send_to="1", extra=s3_env)
    holder = SidecarProc(1, 2, root / "holder", ports, hold="0", extra=s3_env)
    procs = [owner, holder]
    data = pattern(SIZE, 7)
    out = np.empty(SIZE, dtype=np.uint8)
    out[:] = 1  # prefaulted, like the trainer's parameters
    results: dict[str, list[float]] = {"memcpy": [], "raw_tcp": [], "local": [], "peer": [],
                                       "s3": []}
    try:
        own = owner.slots(SIZE)
        commit_version(own, VERSION, data)
        owner.api("POST", "/notify", {"version": VERSION})
        wait_until(lambda: any(r["complete"] for r in holder.api("GET", "/inventory")["replicas"]),
                   every=0.1)
        if s3_env:
            owner.api("POST", "/persist", {"version": VERSION})
            with holder.slots(4096) as tiny:  # rank 1's own (small) shard, so the step commits
                commit_version(tiny, VERSION, data[:4096])
            holder.api("POST", "/persist", {"version": VERSION})
            owner.api("POST", "/commit", {"version": VERSION})
        owner.stop()  # the pod is lost; its replacement starts with empty memory
        fresh = SidecarProc(0, 2, root / "replacement", ports, send_to="1", extra=s3_env)
        procs.append(fresh)
        for i in range(RUNS):
            results["memcpy"].append(timed(lambda: np.copyto(out, data)))
            rate, _ = raw_run(own.path)
            results["raw_tcp"].append(SIZE / (rate * (1 << 30)))
            results["local"].append(timed(lambda: trainer_read(own, out)))
            with fresh.slots(SIZE) as mine:  # the replacement trainer's view of its shm
                def from_peer() -> None:
                    fresh.api("POST", "/fetch", {"rank": 0, "version": VERSION, "holders": [1]})
                    trainer_read(mine, out)

                def from_s3() -> None:
                    fresh.api("POST", "/restore", {"version": VERSION})
                    trainer_read(mine, out)

                results["peer"].append(timed(from_peer))
                assert np.array_equal(out, data)
                forget(mine)
                if s3_env:
                    results["s3"].append(timed(from_s3))
                    assert np.array_equal(out, data)
                    forget(mine)
            print(f"run {i}: " + ", ".join(f"{k} {v[-1]:.3f} s" for k, v in results.items() if v),
                  flush=True)
        own.close()
    finally:
        for proc in procs:
            proc.stop()
        shutil.rmtree(root, ignore_errors=True)
        if s3_env:
            from gemini_local.s3 import stop_s3

            stop_s3(s3_state)
        shutil.rmtree(s3_state, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in results.items() if v}
    print(f"restore of {SIZE} bytes, medians: "
          + ", ".join(f"{k} {v:.3f} s" for k, v in med.items()))
    print(json.dumps({
        "metric": "peer_restore_time_vs_raw_tcp_plus_local_restore",
        "value": round(med["peer"] / (med["raw_tcp"] + med["local"]), 3),
        "target": 1.5, "better": "lower", "unit": "ratio",
        "seconds": {k: round(v, 3) for k, v in med.items()},
    }))


if __name__ == "__main__":
    main()
