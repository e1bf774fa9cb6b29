"""The demo's trainer crash kills the launcher's training process, not the launcher."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from gemini_demo.crash import kill_training_process
from gemini_local.faults import FaultError

# A stand-in launcher: starts a child in a session of its own (as gemini launch does), prints
# the child's pid, and waits for it.
LAUNCHER = """
import subprocess, sys
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                         start_new_session=True)
print(child.pid, flush=True)
sys.exit(0 if child.wait() == 0 else 7)
"""


def test_the_training_process_dies_and_the_launcher_sees_it(tmp_path: Path) -> None:
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER], stdout=subprocess.PIPE,
                                text=True)
    try:
        assert launcher.stdout is not None
        child = int(launcher.stdout.readline())
        pid_file = tmp_path / "nodes/node-1/pods/ns_job-worker-1_uid/containers/trainer.pid"
        pid_file.parent.mkdir(parents=True)
        pid_file.write_text(f"{launcher.pid}\n")
        assert kill_training_process(tmp_path, "ns", "job-worker-1") == child
        assert launcher.wait(timeout=10) == 7  # the launcher outlived its child
    finally:
        launcher.kill()
        launcher.wait()


def test_no_training_process_is_an_error_naming_the_pod(tmp_path: Path) -> None:
    with pytest.raises(FaultError, match="ns/job-worker-1"):
        kill_training_process(tmp_path, "ns", "job-worker-1")
