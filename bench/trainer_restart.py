"""Trainer restart time with and without the launcher's warm standby, side by side.

Four `gemini launch` processes (hold mode, as the operator runs them) train
examples/train_gpt_zero3.py with DeepSpeed ZeRO-3 on loopback, checkpointing into shared
memory every step. A crash: rank 1's training process is SIGKILLed and every launcher gets
POST /restart (restore "latest" from local memory, a new rendezvous port), as the operator
does for a trainer crash. The figure is the time from the kill to the first step every rank
printed again, with the standby (default) over the same with GEMINI_LAUNCHER_STANDBY=0, in
the same run. No sidecar, no operator: only the launcher's and the training processes' share.

    .venv/bin/python bench/trainer_restart.py [--crashes 3] [--workers 4]

With --idle, the crash with the defaults (no kept standby; the launcher whose process died
starts warming the next one at once, GEMINI_LAUNCHER_HOLD_STANDBY=1) against no standby of
any kind; --idle-seconds (default 2: the operator's detection and planning) pass between the
kill and the /restart, and the figure is counted from the kill.

With --replacement, what a lost node costs the training instead: rank 1's whole launcher is
killed and a new one started in hold mode, as in a replacement pod; after --hold-seconds (the
operator's planning and fetching, 3 s by default) every launcher gets POST /restart. The
figure is the time from that /restart to the first step every rank printed, with the held
launcher warming its first interpreter (GEMINI_LAUNCHER_HOLD_STANDBY=1, the default) over the
same without (=0); GEMINI_LAUNCHER_STANDBY=0 in both.

Ctrl-C or SIGTERM (a timeout) stops it cleanly: what it started is torn down (exit 130/143).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from support.cleanup import cleaning_up

from gemini_local.processes import venv_tools_env

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "train_gpt_zero3.py"
MODEL = ["--layers", "1", "--d-model", "32", "--heads", "2", "--seed", "1234"]
TOKEN = "bench-token-0123456789"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Rank:
    def __init__(self, work: Path, rank: int, world: int, settings: dict[str, str],
                 name: str = "") -> None:
        self.dir = work / (name or f"rank{rank}")
        self.dir.mkdir(parents=True)
        self.log = self.dir / "out.log"
        self.status_file = self.dir / "status.json"
        env = {**venv_tools_env(sys.executable, os.environ),  # ninja and JIT folder as pods'
               "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": "0",
               "MASTER_ADDR": "127.0.0.1", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
               "GEMINI_SHM_DIR": str(work / "shm"), "GEMINI_LAUNCHER_HOLD": "1",
               "GEMINI_LAUNCHER_HOST": "127.0.0.1", "GEMINI_LAUNCHER_PORT": "0",
               "GEMINI_LAUNCHER_STATUS_FILE": str(self.status_file),
               "GEMINI_HEARTBEAT_FILE": str(self.dir / "heartbeat"), "GEMINI_AUTH_TOKEN": TOKEN,
               **settings}
        cmd = [sys.executable, "-m", "gemini_cli", "launch", "--",
               str(Path(sys.executable).parent / "python"), str(EXAMPLE), "--engine",
               "deepspeed", "--steps", "100000", *MODEL, "--step-sleep", "0.3"]
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                         cwd=REPO, start_new_session=True)

    def status(self) -> dict[str, Any]:
        status: dict[str, Any] = json.loads(self.status_file.read_text())
        return status

    def call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        req = urllib.request.Request(f"http://127.0.0.1:{self.status()['port']}{path}",
                                     data=json.dumps(body).encode(), method="POST")
        req.add_header("Authorization", f"Bearer {TOKEN}")
        with urllib.request.urlopen(req, timeout=120) as resp:
            answer: dict[str, Any] = json.loads(resp.read())
            return answer

    def steps_after(self, offset: int) -> list[int]:
        with open(self.log, "rb") as f:
            f.seek(offset)
            text = f.read().decode(errors="replace")
        return [int(line.split()[1]) for line in text.splitlines()
                if line.startswith("step ") and len(line.split()) == 4]

    def size(self) -> int:
        return self.log.stat().st_size


def wait(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.05)


def stepped(ranks: list[Rank], offsets: list[int]) -> list[int]:
    """Steps each rank printed since its log had the given size."""
    return [len(r.steps_after(o)) for r, o in zip(ranks, offsets, strict=True)]


def restart_all(ranks: list[Rank], epoch: int, version: Any) -> None:
    body = {"epoch": epoch, "version": version, "source": "local",
            "env": {"MASTER_PORT": str(free_port())}}
    threads = [threading.Thread(target=r.call, args=("/restart", body)) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def standby_settings(standby: bool) -> dict[str, str]:
    """The kept standby (warmStandby) against no standby of any kind."""
    return {"GEMINI_LAUNCHER_STANDBY": "1" if standby else "0",
            "GEMINI_LAUNCHER_HOLD_STANDBY": "1" if standby else "0"}


def hold_settings(warm: bool) -> dict[str, str]:
    return {"GEMINI_LAUNCHER_STANDBY": "0", "GEMINI_LAUNCHER_HOLD_STANDBY": "1" if warm else "0"}


def replace_rank(ranks: list[Rank], work: Path, settings: dict[str, str], crash: int,
                 hold_s: float) -> None:
    """Rank 1's node is lost: its launcher and training process die, a new launcher starts
    held (its shard is where the old one left it, as after a fetch), then `hold_s` passes."""
    old = ranks[1]
    os.killpg(old.proc.pid, signal.SIGKILL)
    old.proc.wait(timeout=30)
    ranks[1] = Rank(work, 1, len(ranks), settings, name=f"rank1-replacement{crash}")
    wait(lambda: ranks[1].status_file.exists(), 120, "the replacement's launcher")
    time.sleep(hold_s)


def one_mode(root: Path, label: str, settings: dict[str, str], workers: int, crashes: int,
             between: int = 20, hold_s: float | None = None, idle_s: float = 0.0
             ) -> tuple[list[float], list[bool]]:
    """Per crash, the seconds until every rank stepped again (from the kill, or with
    `hold_s`, a replacement, from the /restart) and whether every process started warm."""
    work = root / label
    ranks = [Rank(work, r, workers, settings) for r in range(workers)]
    times, warm = [], []
    try:
        wait(lambda: all(r.status_file.exists() for r in ranks), 120, "the launchers")
        restart_all(ranks, 1, None)
        for crash in range(crashes):
            marks = [r.size() for r in ranks]
            # steady training for a while (the next standbys warm meanwhile, at low priority)
            wait(lambda m=marks: min(stepped(ranks, m)) >= between, 600, "training steps")
            marks = [r.size() for r in ranks]
            start = time.monotonic()
            if hold_s is None:
                os.killpg(ranks[1].status()["pid"], signal.SIGKILL)
                time.sleep(idle_s)
            else:
                replace_rank(ranks, work, settings, crash, hold_s)
                marks[1], start = 0, time.monotonic()
            restart_all(ranks, crash + 2, "latest")
            wait(lambda m=marks: min(stepped(ranks, m)) >= 1, 600,
                 "the first step after the restart")
            times.append(time.monotonic() - start)
            warm.append(ranks[1].status()["warm"])
            print(f"{label} crash {crash}: {times[-1]:.2f} s (rank 1 warm {warm[-1]})",
                  flush=True)
    finally:
        for r in ranks:
            try:
                r.call("/stop", {})
            except OSError:
                os.killpg(r.proc.pid, signal.SIGKILL)
        for r in ranks:
            r.proc.wait(timeout=60)
    return times, warm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--crashes", type=int, default=3)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--steps-between", type=int, default=20,
                        help="steps trained before each crash (the standby warms meanwhile)")
    parser.add_argument("--idle", action="store_true",
                        help="the default idle standby after a crash, not the kept one")
    parser.add_argument("--idle-seconds", type=float, default=2.0,
                        help="with --idle: from the kill to the /restart")
    parser.add_argument("--replacement", action="store_true",
                        help="replace rank 1's launcher (a lost node) instead of a crash")
    parser.add_argument("--hold-seconds", type=float, default=3.0,
                        help="with --replacement: from the new launcher's start to /restart")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="gbench-restart-", dir="/tmp"))
    hold = args.hold_seconds if args.replacement else None
    settings = hold_settings if args.replacement or args.idle else standby_settings
    idle = args.idle_seconds if args.idle else 0.0
    with cleaning_up():  # the launchers (and their trainers) stopped, also when interrupted
        cold, _ = one_mode(root, "spawn", settings(False), args.workers, args.crashes,
                           args.steps_between, hold, idle)
        warm, used = one_mode(root, "warm", settings(True), args.workers, args.crashes,
                              args.steps_between, hold, idle)
    shutil.rmtree(root, ignore_errors=True)  # kept when it failed, for its logs
    cold_m, warm_m = statistics.median(cold), statistics.median(warm)
    what = "replacement held, /restart" if args.replacement else "restart"
    print(f"{what} to first step: warm {warm_m:.2f} s (runs {[round(t, 2) for t in warm]}),"
          f" fresh spawn {cold_m:.2f} s (runs {[round(t, 2) for t in cold]})")
    metric = ("replacement_start_hold_standby_vs_spawn" if args.replacement
              else "trainer_restart_idle_standby_vs_spawn" if args.idle
              else "trainer_restart_standby_vs_spawn")
    print(json.dumps({
        "metric": metric, "value": round(warm_m / cold_m, 3),
        "target": 0.6, "better": "lower", "unit": "ratio",
        "standby_seconds": round(warm_m, 2), "spawn_seconds": round(cold_m, 2),
        "workers": args.workers, "crashes": args.crashes, "all_warm": all(used),
        **({"hold_seconds": args.hold_seconds} if args.replacement else {}),
        "load_average": round(os.getloadavg()[0], 1),
    }))


if __name__ == "__main__":
    main()
