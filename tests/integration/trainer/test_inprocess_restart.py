"""In-process restarts: a training process run through gemini_trainer.run that fails parks on
its line to the launcher, and the next /restart reaches it in place (same pid), with the new
epoch's environment; a process that cannot park is restarted the usual way."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gemini.control import files
from gemini_trainer.launch_config import LauncherConfig
from gemini_trainer.launcher import Launcher
from tests.integration.trainer.test_launcher import TOKEN, Running, alive

pytestmark = pytest.mark.integration

# main() appends "<pid> <epoch> <version> <calls>" to argv[1], then, on the first call of all
# processes: "raise", "die" (exit 3 after a last word), "loop" (sleep in Python until
# SIGUSR1), "stuck" (SIGUSR1 blocked, as in a collective that never returns), "slow" (as "loop",
# leaving garbage whose collection in the teardown takes 2 s), "unwind" (as "loop", its stack's
# unwinding taking 2 s before run() can park); "ok" (return 0) on later calls.
CHILD = """
import gc, os, signal, sys, time
from gemini_trainer import run
calls = 0
class Slow:
    def __del__(self):
        time.sleep(2)
def main():
    global calls
    calls += 1
    e = os.environ
    first = not os.path.exists(sys.argv[1])
    with open(sys.argv[1], 'a') as f:
        f.write(f"{os.getpid()} {e['GEMINI_RESTART_EPOCH']} "
                f"{e.get('GEMINI_RESTORE_VERSION', '-')} {calls}\\n")
    mode = sys.argv[2] if first else 'ok'
    if mode == 'raise':
        raise RuntimeError('Connection closed by peer [10.0.0.2]:29500')
    if mode == 'die':
        print('RuntimeError: CUDA error: out of memory', flush=True)
        os._exit(3)
    if mode == 'slow':
        gc.disable()  # collected by the teardown's gc.collect(), not in the loop
        cycle = Slow()
        cycle.me = cycle
        del cycle
    if mode in ('loop', 'slow'):
        while True:
            time.sleep(0.05)
    if mode == 'unwind':
        try:
            while True:
                time.sleep(0.05)
        finally:
            time.sleep(2)
    if mode == 'stuck':
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
        time.sleep(120)
    return 0
sys.exit(run(main))
"""


@pytest.fixture()
def start(tmp_path: Path) -> Iterator[Any]:
    started: list[Running] = []

    def _start(mode: str, **config: Any) -> Running:
        heartbeat = tmp_path / "hb" / "heartbeat"
        heartbeat.parent.mkdir(exist_ok=True)
        launcher = Launcher(LauncherConfig(
            command=(sys.executable, "-c", CHILD, str(tmp_path / "calls"), mode),
            port=0, token=TOKEN, grace_s=2.0, heartbeat_file=heartbeat,
            status_file=tmp_path / "status.json", **config),
            env={**os.environ, "GEMINI_RESTART_EPOCH": "1"})
        running = Running(launcher)
        started.append(running)
        return running

    yield _start
    for running in started:
        running.close()


def calls(tmp_path: Path) -> list[list[str]]:
    path = tmp_path / "calls"
    return [line.split() for line in path.read_text().splitlines()] if path.exists() else []


def restart(running: Running, epoch: int) -> dict[str, Any]:
    code, body = running.call("POST", "/restart", {"epoch": epoch, "version": 7,
                                                   "source": "local",
                                                   "env": {"MASTER_PORT": "31234"}})
    assert code == 200, body
    return body


def restart_while_running(running: Running, tmp_path: Path) -> tuple[int, dict[str, Any], float]:
    """Once main()'s first call runs (and its line is up), POST /restart: the first process's
    pid, the answer and how long it took."""
    first = running.until(lambda s: s["state"] == "running" and len(calls(tmp_path)) == 1)
    time.sleep(0.3)  # connected to the launcher
    asked = time.monotonic()
    body = restart(running, 2)
    return int(first["pid"]), body, time.monotonic() - asked


def assert_ran_on_in_place(running: Running, tmp_path: Path, pid: int) -> None:
    """main() was called again in the same process, with the new epoch and version, and
    training ended there."""
    running.thread.join(20)
    assert running.code == 0
    assert [c[:3] for c in calls(tmp_path)] == [[str(pid), "1", "-"], [str(pid), "2", "7"]]


def test_a_failed_process_parks_and_the_next_restart_runs_main_again_in_it(
        start: Any, tmp_path: Path) -> None:
    running = start("raise")
    parked = running.until(lambda s: s["state"] == "parked")
    pid = parked["pid"]
    assert "Connection closed by peer" in parked["error"] and parked["exit_code"] is None
    marker = files.read_parked(files.parked_path(running.launcher.heartbeat_file))
    assert marker is not None and marker.epoch == 1 and "Connection closed" in marker.error
    assert json.loads((tmp_path / "status.json").read_text())["state"] == "parked"

    body = restart(running, 2)
    assert body["result"] == "restarted" and body["pid"] == pid and body["in_process"] == 1
    running.thread.join(20)
    assert running.code == 0, "main() succeeded on its second call: training is done"
    assert calls(tmp_path) == [[str(pid), "1", "-", "1"], [str(pid), "2", "7", "2"]]
    assert not files.parked_path(running.launcher.heartbeat_file).exists()


def test_a_running_process_is_asked_to_park_with_sigusr1(start: Any, tmp_path: Path) -> None:
    running = start("loop")
    pid, body, _ = restart_while_running(running, tmp_path)
    assert body["pid"] == pid and body["in_process"] == 1
    assert_ran_on_in_place(running, tmp_path, pid)


def test_a_process_whose_teardown_outlasts_the_grace_period_still_restarts_in_place(
        start: Any, tmp_path: Path) -> None:
    """It says it parks before tearing the failed attempt down (DeepSpeed's state, process
    groups, garbage): on a busy machine that took longer than the grace period."""
    running = start("slow", park_grace_s=0.5)
    pid, body, _ = restart_while_running(running, tmp_path)
    assert body["pid"] == pid and body["in_process"] == 1, body
    assert_ran_on_in_place(running, tmp_path, pid)


def test_a_process_whose_unwinding_outlasts_the_grace_period_still_restarts_in_place(
        start: Any, tmp_path: Path) -> None:
    """Asked with SIGUSR1, it says "parking" before its stack unwinds (finally blocks, engine
    teardown: seconds on a busy machine), and the launcher waits past the grace for it."""
    running = start("unwind", park_grace_s=0.5)
    pid, body, took = restart_while_running(running, tmp_path)
    assert took >= 1.5, "the answer waited for the park"
    assert body["pid"] == pid and body["in_process"] == 1, body
    assert_ran_on_in_place(running, tmp_path, pid)


def test_a_process_that_unwinds_past_the_unwind_time_is_replaced(
        start: Any, tmp_path: Path) -> None:
    running = start("unwind", park_grace_s=0.5, park_unwind_s=0.5)
    pid, body, _ = restart_while_running(running, tmp_path)
    assert body["pid"] != pid and body["in_process"] == 0
    running.thread.join(30)
    assert running.code == 0


def test_a_process_that_cannot_park_is_replaced_after_the_grace_period(
        start: Any, tmp_path: Path) -> None:
    running = start("stuck", park_grace_s=0.5)
    pid, body, _ = restart_while_running(running, tmp_path)
    assert body["pid"] != pid and body["in_process"] == 0
    assert not alive(pid)
    running.thread.join(30)
    assert running.code == 0
    assert calls(tmp_path)[1][1:] == ["2", "7", "1"], "a fresh process: main()'s first call"


def test_a_parked_process_no_restart_reaches_is_ended(start: Any, tmp_path: Path) -> None:
    running = start("raise", park_timeout_s=1.0)
    parked = running.until(lambda s: s["state"] == "parked")
    exited = running.until(lambda s: s["state"] == "exited", 15)
    assert exited["exit_code"] == -signal.SIGTERM and not alive(parked["pid"])
    assert running.thread.is_alive(), "the launcher stays up for the operator's next epoch"


def test_a_process_that_dies_is_reported_with_its_last_words_and_the_launcher_stays_up(
        start: Any, tmp_path: Path) -> None:
    running = start("die")
    exited = running.until(lambda s: s["state"] == "exited")
    assert exited["exit_code"] == 3 and running.thread.is_alive()
    marker = files.read_parked(files.parked_path(running.launcher.heartbeat_file))
    assert marker is not None and marker.epoch == 1 and marker.exit_code == 3
    assert "exited with code 3" in marker.error and "CUDA error: out of memory" in marker.error
    body = restart(running, 2)
    assert body["pid"] != exited["pid"] and body["in_process"] == 0
    running.thread.join(20)
    assert running.code == 0
    assert not files.parked_path(running.launcher.heartbeat_file).exists()


def test_in_process_restarts_can_be_turned_off(start: Any, tmp_path: Path) -> None:
    running = start("raise", in_process=False)
    exited = running.until(lambda s: s["state"] == "exited")
    assert exited["exit_code"] == 1, "without the launcher's line run() is main()"
    body = restart(running, 2)
    assert body["pid"] != exited["pid"] and body["in_process"] == 0
