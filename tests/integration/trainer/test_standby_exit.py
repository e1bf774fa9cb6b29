"""How a standby process looks from outside, and how it ends.

A standby whose launcher is killed gets EOF on its control pipe and SIGTERM (its
parent-death signal) at once, and must exit. A SIGTERM handler that took a lock the main
thread held while it handled the EOF (Event.set) hung 4 of 8 such standbys for good, each an
orphaned interpreter (with torch, 0.7 GB) outliving its pod on the local cluster."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from gemini_demo.crash import children, group_leaders_below, is_waiting_standby
from gemini_trainer.standby import STANDBY_NAME

pytestmark = pytest.mark.integration

ROUNDS = 20  # the old handler hung 1 in 12 here, 1 in 2 from a shell: a race


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def standby_ready(status_file: Path) -> bool:
    """From GET /status (the status file is written when the process's state changes)."""
    try:
        port = json.loads(status_file.read_text())["port"]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/status", timeout=5) as answer:
            return bool((json.load(answer).get("standby") or {}).get("ready"))
    except (OSError, ValueError, KeyError):
        return False


def launcher_with_a_ready_standby(tmp_path: Path) -> tuple[subprocess.Popen[bytes], int]:
    # TMPDIR: a killed launcher cannot remove its temporary folder; it goes with tmp_path.
    env = {**os.environ, "GEMINI_LAUNCHER_STANDBY": "1", "GEMINI_LAUNCHER_PREIMPORT": "fractions",
           "TMPDIR": str(tmp_path)}
    tmp_path.mkdir()
    status = tmp_path / "status.json"
    cmd = [sys.executable, "-m", "gemini_cli", "launch", "--insecure-local", "--port", "0",
           "--status-file", str(status), "--", sys.executable, "-c", "import time; time.sleep(60)"]
    launcher = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while not standby_ready(status):
        assert time.monotonic() < deadline, "the launcher's standby did not get ready"
        assert launcher.poll() is None, "the launcher exited"
        time.sleep(0.05)
    standbys = [p for p in children(launcher.pid) if is_waiting_standby(p)]
    assert len(standbys) == 1, standbys
    return launcher, standbys[0]


def test_the_standby_of_a_killed_launcher_exits(tmp_path: Path) -> None:
    hung: list[int] = []
    for round_ in range(ROUNDS):
        launcher, standby = launcher_with_a_ready_standby(tmp_path / str(round_))
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
        deadline = time.monotonic() + 10
        while alive(standby) and time.monotonic() < deadline:
            time.sleep(0.05)
        if alive(standby):
            hung.append(standby)
            os.kill(standby, signal.SIGKILL)
    assert not hung, f"{len(hung)} of {ROUNDS} standbys outlived their killed launcher"


def test_a_waiting_standby_is_named_so_and_fault_tools_pass_it_over(tmp_path: Path) -> None:
    launcher, standby = launcher_with_a_ready_standby(tmp_path / "named")
    try:
        assert Path(f"/proc/{standby}/comm").read_text().strip() == STANDBY_NAME
        training = [p for p in children(launcher.pid) if p != standby]
        assert group_leaders_below(launcher.pid) == training  # what a trainer crash kills
    finally:
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
