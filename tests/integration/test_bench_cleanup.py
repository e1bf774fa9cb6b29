"""bench/support/cleanup.py: a benchmark stopped by SIGTERM runs its `finally` blocks, passes
the signal on to the child it waits for, stops every other child, and exits with 143."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

BENCH = Path(__file__).resolve().parents[2] / "bench"

CHILD = textwrap.dedent("""
    import signal, sys, time
    def stop(*_):
        open(sys.argv[1], "w").write(signal.Signals(_[0]).name)
        sys.exit(0)
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    time.sleep(300)
""")

BENCH_SCRIPT = textwrap.dedent("""
    import subprocess, sys, time
    sys.path.insert(0, sys.argv[1])
    from support.cleanup import cleaning_up

    with cleaning_up() as cleanup:
        child = cleanup.spawn([sys.executable, "-c", sys.argv[2], sys.argv[3]])
        stray = subprocess.Popen(["sleep", "300"])  # started, never stopped by the bench
        print(child.pid, stray.pid, flush=True)
        try:
            time.sleep(300)
        finally:
            print("finally ran, child exit", cleanup.stop_child(child), flush=True)
""")


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_the_bench_and_everything_it_started(tmp_path: Path, sig: int) -> None:
    marker = tmp_path / "child-got"
    proc = subprocess.Popen([sys.executable, "-c", BENCH_SCRIPT, str(BENCH), CHILD, str(marker)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        assert proc.stdout is not None
        child, stray = map(int, proc.stdout.readline().split())
        time.sleep(0.5)  # the child installed its handler
        proc.send_signal(sig)
        output = proc.stdout.read()
        assert proc.wait(timeout=30) == 128 + sig, output
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    name = signal.Signals(sig).name
    assert "finally ran, child exit 0" in output
    assert f"stopped by {name}; everything it started is torn down" in output
    assert marker.read_text() == name  # passed on, not a SIGKILL
    deadline = time.monotonic() + 10
    while (alive(child) or alive(stray)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(child) and not alive(stray)


SLOW_UNDO = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, sys.argv[1])
    from support.cleanup import cleaning_up

    def undo():
        print("undo started", flush=True)
        time.sleep(2)
        print("undo done", flush=True)

    with cleaning_up() as cleanup:
        cleanup.at_exit(undo)
""")


def test_a_signal_during_the_clean_up_lets_it_finish() -> None:
    proc = subprocess.Popen([sys.executable, "-c", SLOW_UNDO, str(BENCH)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "undo started"
        proc.send_signal(signal.SIGTERM)
        output = proc.stdout.read()
        assert proc.wait(timeout=30) == 143, output
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert output.splitlines()[0] == "undo done", output
    assert "stopped by SIGTERM; everything it started is torn down" in output
