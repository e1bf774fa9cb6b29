"""The uninterrupted reference: the same training script and arguments as N plain local
processes (no Kubernetes, no failures), whose per-step losses the demo's run must equal."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from gemini_demo.reference_cache import Losses, ReferenceCache
from gemini_demo.report import parse_losses
from gemini_local.processes import free_port


class ReferenceRunError(RuntimeError):
    """The reference run failed; the message carries the tail of its output."""


@dataclass
class ReferenceRun:
    """One process per rank with RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT set; with
    a `cache`, a run of the same content kept from before is used instead (no process)."""

    script: Path
    args: list[str]
    world: int
    log_dir: Path
    procs: list[subprocess.Popen[bytes]] | None = None
    started_at: float = 0.0
    restarts_left: int = 2
    cache: ReferenceCache | None = None
    cached: Losses | None = None

    def start(self) -> ReferenceRun:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.started_at = time.monotonic()
        if self.cache is not None:
            self.cached = self.cache.get(self.script, self.world, self.args)
            if self.cached is not None:
                return self
        port = free_port()
        self.procs = []
        for rank in range(self.world):
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(self.world),
                       LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                       OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
            # A gemini_trainer Checkpointer with no sidecar configured keeps its snapshots
            # to itself: the reference shares nothing with the demo's job.
            for key in [k for k in env if k.startswith("GEMINI_")]:
                del env[key]
            shm = self.log_dir / "shm"
            shm.mkdir(exist_ok=True)
            env.update(GEMINI_SHM_DIR=str(shm), GEMINI_JOB="reference")
            with open(self.log_path(rank), "wb") as log:
                self.procs.append(subprocess.Popen(
                    [sys.executable, str(self.script), *self.args], env=env, stdout=log,
                    stderr=subprocess.STDOUT, start_new_session=True))
        return self

    def log_path(self, rank: int) -> Path:
        return self.log_dir / f"reference-rank{rank}.log"

    def running(self) -> bool:
        return any(p.poll() is None for p in self.procs or [])

    def wait(self, timeout: float) -> dict[int, str]:
        """Rank 0's losses once every rank exited 0; raises with the output otherwise.

        A rank that fails ends the run at once (its peers would wait for it until the
        timeout); a rendezvous port taken meanwhile by another process restarts it."""
        if self.cached is not None:
            return dict(self.cached[0])
        deadline = time.monotonic() + timeout
        while self.running() and not self._a_rank_failed():
            if time.monotonic() > deadline:
                self.stop()
                raise ReferenceRunError(f"the reference run did not finish in {timeout:.0f}s:\n"
                                     f"{self.tail()}")
            time.sleep(0.5)
        self.stop()
        codes = [p.returncode for p in self.procs or []]
        if any(codes) and self._port_was_taken() and self.restarts_left > 0:
            self.restarts_left -= 1
            self.start()
            return self.wait(max(1.0, deadline - time.monotonic()))
        if any(codes):
            raise ReferenceRunError(f"the reference run failed (exit codes {codes}):\n"
                                 f"{self.tail()}")
        every_rank = [dict(parse_losses(self.log_path(r).read_text(errors="replace")
                                        .splitlines())) for r in range(self.world)]
        if self.cache is not None:
            self.cache.put(self.script, self.world, self.args, every_rank)
        return every_rank[0]

    def _a_rank_failed(self) -> bool:
        return any(p.poll() not in (None, 0) for p in self.procs or [])

    def _port_was_taken(self) -> bool:
        return any("EADDRINUSE" in self.log_path(rank).read_text(errors="replace")
                   for rank in range(self.world))

    def stop(self) -> None:
        for proc in self.procs or []:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()

    def tail(self, lines: int = 15) -> str:
        if self.cached is not None:
            return "(the reference's losses came from the cache)"
        out = []
        for rank in range(self.world):
            text = self.log_path(rank).read_text(errors="replace").splitlines()
            out.append(f"--- reference rank {rank} ({self.log_path(rank)})")
            out += text[-lines:]
        return "\n".join(out)
