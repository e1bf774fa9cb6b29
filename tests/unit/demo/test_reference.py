"""The reference run's own failure handling, with tiny scripts in place of training."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from gemini_demo.reference import ReferenceRun, ReferenceRunError

RANK_1_FAILS = """
import os, sys, time
if os.environ["RANK"] == "1":
    sys.exit(3)
time.sleep(60)
"""

# The first attempt's port is taken: every rank started on it fails, whichever of them the
# run stops first (a rank killed before it looked must not make the next attempt fail too).
PORT_TAKEN_ONCE = """
import os, pathlib, sys
first = pathlib.Path(sys.argv[1]) / "first-port"
try:
    with open(first, "x") as out:
        out.write(os.environ["MASTER_PORT"])
except FileExistsError:
    pass
if first.read_text() == os.environ["MASTER_PORT"]:
    print("DistNetworkError: port: " + os.environ["MASTER_PORT"] + ", name: EADDRINUSE")
    sys.exit(1)
print("step 1 loss 0x1.8p+1")
"""


def _run(tmp_path: Path, code: str, *args: str) -> ReferenceRun:
    script = tmp_path / "script.py"
    script.write_text(code)
    return ReferenceRun(script, list(args), 2, tmp_path / "logs").start()


def test_a_failing_rank_ends_the_run_at_once_instead_of_at_the_timeout(tmp_path: Path) -> None:
    run = _run(tmp_path, RANK_1_FAILS)
    began = time.monotonic()
    with pytest.raises(ReferenceRunError, match=r"failed \(exit codes"):
        run.wait(timeout=50)
    assert time.monotonic() - began < 20
    assert not run.running()


def test_a_taken_rendezvous_port_restarts_the_run_on_another(tmp_path: Path) -> None:
    run = _run(tmp_path, PORT_TAKEN_ONCE, str(tmp_path))
    assert run.wait(timeout=50) == {1: "0x1.8p+1"}
    assert run.restarts_left == 1
