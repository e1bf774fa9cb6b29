"""Shared by the sidecar benchmarks: run `gemini sidecar` processes and play the trainer."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
for extra in (ROOT, ROOT / "trainer_sidecar"):
    sys.path.insert(0, str(extra))

from gemini.slots.layout import shard_path  # noqa: E402
from gemini.slots.shard import ShardSlots  # noqa: E402

JOB = "bench"
TOKEN = "bench-job-token-0123456789abcdef"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def pattern(size: int, seed: int) -> np.ndarray:
    """`size` pseudo-random bytes, cheap to make (a random 16 MiB block, tiled and salted)."""
    block = np.random.default_rng(seed).integers(0, 256, 16 << 20, dtype=np.uint8)
    reps = -(-size // block.size)
    return np.tile(block, reps)[:size]


class SidecarProc:
    """One `gemini sidecar` process; `api(...)` calls its control API with the job token."""

    def __init__(self, rank: int, world: int, shm_root: Path, ports: dict[int, int],
                 hold: str = "", send_to: str = "", extra: dict[str, str] | None = None) -> None:
        self.rank = rank
        self.shm_dir = shm_root / f"rank{rank}"
        self.shm_dir.mkdir(parents=True, exist_ok=True)
        self.api_port = free_port()
        env = dict(os.environ)
        env.update({
            "GEMINI_JOB": JOB, "GEMINI_RANK": str(rank), "GEMINI_WORLD_SIZE": str(world),
            "GEMINI_AUTH_TOKEN": TOKEN, "GEMINI_MEMORY_BUDGET_BYTES": str(8 << 30),
            "GEMINI_PEERS": ",".join(f"{r}=127.0.0.1:{p}" for r, p in ports.items()),
            "GEMINI_HOLD_RANKS": hold, "GEMINI_SEND_TO": send_to,
            "GEMINI_POD_IP": "127.0.0.1", "GEMINI_SIDECAR_PORT": str(ports[rank]),
            "GEMINI_SIDECAR_API_PORT": str(self.api_port), "GEMINI_SHM_DIR": str(self.shm_dir),
            "GEMINI_TRAFFIC_MODE": "immediate",
            "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "trainer_sidecar")]),
        })
        env.update(extra or {})
        code = ("import sys; from gemini_cli import main; "
                "sys.exit(main(['sidecar', '--log-level', 'WARNING']))")
        self.proc = subprocess.Popen([sys.executable, "-c", code], env=env,
                                     stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"sidecar rank {rank} did not start (exit {self.proc.wait()})")
        json.loads(line)

    def api(self, method: str, path: str, body: Any = None, timeout: float = 600) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{self.api_port}{path}", data=data,
                                     method=method)
        req.add_header("Authorization", f"Bearer {TOKEN}")
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read())

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def slots(self, capacity: int | None = None) -> ShardSlots:
        return ShardSlots(shard_path(self.rank, self.shm_dir, JOB), capacity, rank=self.rank)


def commit_version(slots: ShardSlots, version: int, data: np.ndarray) -> int:
    """What the trainer does each step: copy into the free slot and commit (returns CRC)."""
    view = slots.begin(version, data.size)
    np.frombuffer(view, dtype=np.uint8)[:] = data
    view.release()
    return slots.commit(version).checksum


def wait_until(cond: Any, timeout: float = 600.0, every: float = 0.002) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError("benchmark step timed out")
        time.sleep(every)


def local_s3_env(state: Path, cleanup: Any, prefix: str) -> dict[str, str]:
    """Start the local S3 server in `state` (stopped by `cleanup`) and return the sidecar
    environment that points at it."""
    from gemini_local.s3 import start_s3, stop_s3

    cleanup.at_exit(stop_s3, state)
    ep = start_s3(state, stop_with_pid=os.getpid())
    return {"GEMINI_S3_BUCKET": ep.bucket, "GEMINI_S3_ENDPOINT": ep.url,
            "GEMINI_S3_REGION": ep.region, "GEMINI_S3_ACCESS_KEY": ep.access_key,
            "GEMINI_S3_SECRET_KEY": ep.secret_key, "GEMINI_S3_PREFIX": prefix,
            "GEMINI_S3_PART_BYTES": str(64 << 20), "GEMINI_S3_CONCURRENCY": "8"}
