"""In-process recovery of real training: two ranks (gloo, loopback), each under its own
launcher. Rank 1's training process is SIGKILLed; rank 0's collective breaks, it parks and
keeps its process; the next epoch restarts rank 0 in place (same pid, no new interpreter) and
rank 1 as a new process, both restoring the latest version from memory. Proved from the
trainers' own logs: rank 0 says it restarted in process, both restored the same step, the
first step after it is that step + 1, no earlier step ran again, and the losses equal an
uninterrupted run's bit for bit (float hex)."""

from __future__ import annotations

import os
import re
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from gemini_trainer.launch_config import LauncherConfig
from gemini_trainer.launcher import Launcher
from tests.fixtures.trainers import (
    EXAMPLE,
    STEP_LINE,
    SharedReferences,
    free_port,
    rank_env,
)
from tests.integration.trainer.test_launcher import TOKEN, Running

pytestmark = pytest.mark.integration

WORLD = 2
STEPS = 14
MODEL = ["--layers", "2", "--d-model", "32", "--heads", "4", "--seq", "16", "--batch", "4"]
IN_PROCESS = re.compile(r"^gemini: in-process restart: epoch (\d+) \(pid (\d+)\)")
RESTORED = re.compile(r"^restored step (\d+)")

class Rank:
    def __init__(self, rank: int, args: list[str], tmp: Path) -> None:
        self.log = tmp / f"rank{rank}.log"
        # exec keeps the pid: the launcher signals the training process itself
        command = ("/bin/sh", "-c", f'exec "$0" "$@" >>{self.log} 2>&1', sys.executable,
                   str(EXAMPLE), *args)
        heartbeat = tmp / f"hb{rank}" / "heartbeat"
        heartbeat.parent.mkdir()
        env = rank_env(rank, WORLD, 0, {"GEMINI_SHM_DIR": str(tmp / "shm"),
                                        "GEMINI_RESTART_EPOCH": "0"})
        self.running = Running(Launcher(LauncherConfig(
            command=command, port=0, token=TOKEN, grace_s=3.0, hold=True,
            heartbeat_file=heartbeat), env=env))

    def restart(self, epoch: int, port: int, version: Any) -> dict[str, Any]:
        code, body = self.running.call("POST", "/restart", {
            "epoch": epoch, "version": version, "source": "local",
            "env": {"MASTER_PORT": str(port)}})
        assert code == 200, body
        return body

    def lines(self) -> list[str]:
        return self.log.read_text(errors="replace").splitlines() if self.log.exists() else []

    def steps_after(self, marker: re.Pattern[str]) -> list[tuple[int, str]]:
        """(step, loss) lines printed after the last line matching `marker`."""
        lines = self.lines()
        at = max((i for i, line in enumerate(lines) if marker.match(line)), default=-1)
        return [(int(m.group(1)), m.group(2)) for line in lines[at + 1:]
                if (m := STEP_LINE.match(line))]

@pytest.mark.parametrize("engine", [pytest.param("ddp", marks=pytest.mark.long), "deepspeed"])
def test_a_survivor_restarts_in_its_own_process_and_continues_bit_exactly(
        engine: str, tmp_path: Path, shared_references: SharedReferences) -> None:
    args = [*MODEL, "--engine", engine, "--steps", str(STEPS)]
    expected = shared_references(WORLD, args)
    ranks = [Rank(r, [*args, "--step-sleep", "0.3"], tmp_path) for r in range(WORLD)]
    try:
        port = free_port()
        # the launchers of one epoch are told together, as the operator does
        _together(lambda r: r.restart(1, port, None), ranks)
        _until(lambda: all(_progress(r) >= 4 for r in ranks), 300, ranks, "step 4")
        survivor_pid = ranks[0].running.status()["pid"]
        os.kill(ranks[1].running.status()["pid"], signal.SIGKILL)
        killed = time.monotonic()
        parked = ranks[0].running.until(lambda s: s["state"] == "parked", 60)
        print(f"rank 0 parked {time.monotonic() - killed:.2f} s after rank 1 was killed")
        assert parked["pid"] == survivor_pid
        ranks[1].running.until(lambda s: s["state"] == "exited", 20)

        port = free_port()
        ordered = time.monotonic()
        answers = _together(lambda r: r.restart(2, port, "latest"), ranks)
        print(f"restarts answered in {time.monotonic() - ordered:.2f} s")
        assert answers[0]["pid"] == survivor_pid and answers[0]["in_process"] == 1
        assert answers[1]["in_process"] == 0, "the killed rank starts a new process"
        for rank in ranks:
            rank.running.thread.join(120)
            assert rank.running.code == 0, _tails(ranks)
    finally:
        for rank in ranks:
            rank.running.close(15)

    survivor = ranks[0].lines()
    restarts = [m for line in survivor if (m := IN_PROCESS.match(line))]
    assert [(m.group(1), int(m.group(2))) for m in restarts] == [("2", survivor_pid)], (
        "rank 0 must say it restarted in its own process")
    restored = {_restored(r) for r in ranks}
    assert len(restored) == 1 and None not in restored, f"restored steps {restored}"
    step = restored.pop()
    assert step is not None and 4 <= step < STEPS
    for rank in ranks:
        after = rank.steps_after(RESTORED)
        assert [s for s, _ in after] == list(range(step + 1, STEPS + 1)), (
            f"{rank.log.name} did not resume at step {step} + 1:\n" + "\n".join(rank.lines()))
    assert dict(ranks[0].steps_after(RESTORED)) == {s: expected[s] for s in
                                                    range(step + 1, STEPS + 1)}

def _progress(rank: Rank) -> int:
    beat = rank.running.status().get("progress") or {}
    return int(beat.get("step") or 0)

def _restored(rank: Rank) -> int | None:
    found = [int(m.group(1)) for line in rank.lines() if (m := RESTORED.match(line))]
    return found[-1] if found else None

def _together(call: Any, ranks: list[Rank]) -> list[dict[str, Any]]:
    answers: list[Any] = [None] * len(ranks)

    def one(i: int) -> None:
        answers[i] = call(ranks[i])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(ranks))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(a is not None for a in answers), answers
    return answers

def _until(predicate: Any, timeout: float, ranks: list[Rank], what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached in {timeout} s:\n{_tails(ranks)}")
        time.sleep(0.1)



def _tails(ranks: list[Rank]) -> str:
    return "\n".join(f"--- {r.log.name}\n" + "\n".join(
        line for line in r.lines()[-40:] if "Warning" not in line and "return func" not in line)
        for r in ranks)
