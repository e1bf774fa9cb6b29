"""Persisting a node checkpoint to S3 while training runs, against the same upload alone.

A sidecar process holds a version in its slot file (1 GiB, a node checkpoint) and uploads it
to the local S3 server (Ceph RGW, started here) through POST /persist: the version is pinned
for the upload and sent in parts (gemini_sidecar.uploads). Each upload is of a new version. The same
upload runs alone (the trainer stopped) and while a training process (a torch MLP,
OMP_NUM_THREADS=1) trains, alternating, BENCH_RUNS times. The figure: upload throughput while
training / alone (target >= 0.8); the training's step rate during the uploads over its rate
between them is printed beside it (what the upload costs the training). Both compete for the
same cores here (2 on the build machine): quote the load.

    .venv/bin/python bench/persist_while_training.py   (BENCH_BYTES, BENCH_RUNS to change)

Ctrl-C or SIGTERM (a timeout) stops it cleanly: what it started is torn down (exit 130/143).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import boto3

sys.path.insert(0, str(Path(__file__).resolve().parent))

from support.cleanup import Cleanup, cleaning_up
from support.sidecar_procs import SidecarProc, commit_version, free_port, local_s3_env, pattern

from gemini.slots.shard import ShardSlots

SIZE = int(os.environ.get("BENCH_BYTES", str(1 << 30)))
RUNS = int(os.environ.get("BENCH_RUNS", "3"))
TRAINER = """
import sys, time, torch
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(4)])
opt = torch.optim.Adam(model.parameters())
x = torch.randn(64, 1024)
while True:
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()
    print(time.monotonic(), flush=True)
"""


class Training:
    """A training process whose step times are read from its output."""

    def __init__(self, log: Path) -> None:
        self.log = log
        with open(log, "wb") as out:
            self.proc = subprocess.Popen([sys.executable, "-c", TRAINER], stdout=out,
                                         env={**os.environ, "OMP_NUM_THREADS": "1"})

    def steps_between(self, start: float, end: float) -> int:
        stamps = [float(t) for t in self.log.read_text().split()]
        return sum(start <= t <= end for t in stamps)

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


class Versions:
    """A new version committed before each upload (the same one again would be answered from
    the sidecar's note of the finished upload, not sent); each uploaded object is deleted
    after it is timed (the local S3 keeps objects in memory, 8 GiB at most)."""

    def __init__(self, slots: ShardSlots, env: dict[str, str]) -> None:
        self.slots, self.version = slots, 0
        self.data = pattern(SIZE, 3)
        self.s3 = boto3.client(
            "s3", endpoint_url=env["GEMINI_S3_ENDPOINT"], region_name=env["GEMINI_S3_REGION"],
            aws_access_key_id=env["GEMINI_S3_ACCESS_KEY"],
            aws_secret_access_key=env["GEMINI_S3_SECRET_KEY"])
        self.bucket = env["GEMINI_S3_BUCKET"]

    def persist_seconds(self, owner: SidecarProc) -> float:
        self.version += 1
        commit_version(self.slots, self.version, self.data)
        start = time.perf_counter()
        answer = owner.api("POST", "/persist", {"version": self.version})
        took = time.perf_counter() - start
        self.s3.delete_object(Bucket=self.bucket, Key=answer["key"])
        return took


def main() -> None:
    with cleaning_up() as cleanup:
        measure(cleanup)


def measure(cleanup: Cleanup) -> None:
    if not shutil.which("radosgw"):
        raise SystemExit("radosgw is not installed: run ./dev setup first")
    root = Path(tempfile.mkdtemp(prefix="gemini-persist-", dir="/dev/shm"))
    cleanup.at_exit(shutil.rmtree, root, True)
    s3_state = Path(tempfile.mkdtemp(prefix="gemini-persist-s3-"))
    cleanup.at_exit(shutil.rmtree, s3_state, True)
    env = local_s3_env(s3_state, cleanup, "bench-persist")
    owner = SidecarProc(0, 1, root / "owner", {0: free_port()}, extra=env)
    cleanup.at_exit(owner.stop)
    slots = owner.slots(SIZE)
    cleanup.at_exit(slots.close)
    versions = Versions(slots, env)
    versions.persist_seconds(owner)  # warm-up: connections, the bucket's first objects
    alone: list[float] = []
    loaded: list[float] = []
    rates: list[tuple[float, float]] = []  # training steps/s during the upload, between
    training = Training(root / "training.log")
    cleanup.at_exit(training.stop)
    time.sleep(3.0)  # imports done, steady steps
    try:
        for run in range(RUNS):
            training.proc.send_signal(signal.SIGSTOP)  # the upload alone
            alone.append(versions.persist_seconds(owner))
            training.proc.send_signal(signal.SIGCONT)
            time.sleep(1.0)
            begin = time.monotonic()
            loaded.append(versions.persist_seconds(owner))
            end = time.monotonic()
            time.sleep(loaded[-1])
            during = training.steps_between(begin, end) / (end - begin)
            after = training.steps_between(end, time.monotonic()) / (time.monotonic() - end)
            rates.append((during, after))
            print(f"run {run}: alone {alone[-1]:.2f} s, while training {loaded[-1]:.2f} s; "
                  f"training {during:.1f} steps/s during, {after:.1f} after", flush=True)
    finally:
        training.stop()
    gib = SIZE / (1 << 30)
    ratio = statistics.median(alone) / statistics.median(loaded)
    slowdown = statistics.median(d / a for d, a in rates if a > 0)
    print(f"persist of {gib:.2f} GiB: alone {gib / statistics.median(alone):.2f} GiB/s, "
          f"while training {gib / statistics.median(loaded):.2f} GiB/s; the training ran at "
          f"{slowdown:.2f} of its pace during the uploads; load {os.getloadavg()[0]:.1f}")
    print(json.dumps({"metric": "persist_throughput_while_training_over_alone",
                      "value": round(ratio, 3), "target": 0.8, "better": "higher",
                      "unit": "ratio"}))


if __name__ == "__main__":
    main()
