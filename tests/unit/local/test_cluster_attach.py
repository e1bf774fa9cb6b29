"""`gemini local down` also stops what was attached to the cluster (a kept demo's operator),
and only while the recorded pid still runs the recorded program."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from gemini_local import cluster


def _sleeper() -> subprocess.Popen[bytes]:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                            start_new_session=True)
    # An empty command line reads as a process mid-exec, which `down` takes for its own
    # (processes.running_pid): wait until the sleeper shows what it runs.
    cmdline = Path(f"/proc/{proc.pid}/cmdline")
    deadline = time.monotonic() + 10
    while not cmdline.read_bytes() and time.monotonic() < deadline:
        time.sleep(0.01)
    return proc


def test_down_stops_an_attached_process_once(tmp_path):
    proc = _sleeper()
    try:
        cluster.attach(tmp_path, "demo-operator", proc.pid, sys.executable)
        assert cluster.down(tmp_path) == ["demo-operator"]
        assert proc.wait(timeout=10) is not None
        assert cluster.down(tmp_path) == []
    finally:
        proc.kill()
        proc.wait()


def test_a_pid_now_running_another_program_is_left_alone(tmp_path):
    proc = _sleeper()
    try:
        cluster.attach(tmp_path, "demo-operator", proc.pid, "/usr/bin/not-the-operator")
        assert cluster.down(tmp_path) == []
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait()
