"""Tools clean up after themselves (issue 17): `gemini demo`, and a benchmark running it, stopped
by SIGTERM (a timeout) tear down everything they started and exit with 143. (SIGINT takes the
same path: tests/unit/demo/test_interrupt.py, tests/integration/test_bench_cleanup.py.)

Each test starts the tool in a subprocess of its own session, waits until its cluster is up,
sends the signal to that process alone, and then checks, within a bounded time, that it exited
and left nothing: no process whose command line or environment names its state directory
(etcd, API server, KCM, scheduler, node agents, radosgw, the operator, the reference run), no
process in the groups of its nodes, no nftables table of its nodes, no mount under its state
directory and no shared-memory folder of its nodes.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from gemini_local import cluster
from gemini_local.nodeagent.addressing import NodeNetwork

pytestmark = [
    pytest.mark.cluster, pytest.mark.s3,
    pytest.mark.skipif(shutil.which("radosgw") is None, reason="the demo needs radosgw (S3)"),
]

REPO = Path(__file__).resolve().parents[2]
GEMINI = [sys.executable, "-m", "gemini_cli"]
UP_TIMEOUT_S = 150.0  # until the cluster (or the operator) is up, on a busy shared box
STOP_TIMEOUT_S = 90.0  # from the signal until the process exited, its teardown done
# The smallest demo: 2 workers (+2 spares), one failure; the tests never get to train.
DEMO_ARGS = ["demo", "--workers", "2", "--replicas", "2", "--failures", "trainer-crash"]


def wait_for(predicate: Callable[[], Any], timeout: float, what: str,
             proc: subprocess.Popen[bytes] | None = None) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            pytest.fail(f"the tool exited ({proc.returncode}) before {what}")
        time.sleep(0.5)
    pytest.fail(f"no {what} within {timeout:.0f}s")


def nodes_registered(state: Path) -> bool:
    """The state dir's API server answers and lists at least one node."""
    try:
        return bool(cluster.status(state)["nodes"])
    except Exception:  # not started yet, or starting
        return False


def octet(state: Path) -> int | None:
    try:
        return int(json.loads((state / "nodes" / "network.json").read_text())["octet"])
    except (OSError, ValueError, KeyError):
        return None


def _read(path: Path) -> str:
    try:
        return path.read_bytes().decode(errors="replace")
    except OSError:
        return ""


def leftovers(state: Path, net_octet: int) -> list[str]:
    """Everything of the state dir's cluster still there, one line each (empty: nothing)."""
    found = []
    gids = {str(NodeNetwork(net_octet, i).gid) for i in range(64)}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        cmdline, environ = _read(entry / "cmdline"), _read(entry / "environ")
        status = _read(entry / "status")
        gid_line = next((line for line in status.splitlines() if line.startswith("Gid:")), "")
        if "State:\tZ" in status:
            continue
        if str(state) in cmdline or str(state) in environ or set(gid_line.split()[1:]) & gids:
            found.append(f"process {entry.name}: {cmdline.replace(chr(0), ' ')[:200]}")
    if shutil.which("nft"):
        tables = subprocess.run(["nft", "list", "tables"], capture_output=True, text=True,
                                check=False).stdout.split()
        found += [f"nftables table {t}" for t in tables
                  if t.startswith(f"gemini_{net_octet}_")]
    found += [f"mount {line.split()[4]}" for line in _read(Path("/proc/self/mountinfo"))
              .splitlines() if str(state) in line.split()[4]]
    shm = Path(f"/dev/shm/gemini-local-{net_octet}")
    if shm.exists():
        found.append(f"shared memory folder {shm}: {sorted(p.name for p in shm.iterdir())}")
    return found


def assert_seen_running(found: list[str]) -> None:
    """The leak check sees the cluster while it runs (else its empty answer proves nothing)."""
    assert any("etcd" in line for line in found), found
    assert any("gemini_local.nodeagent" in line for line in found), found
    if os.geteuid() == 0 and shutil.which("nft"):
        assert any(line.startswith("nftables table") for line in found), found


def stopped(proc: subprocess.Popen[bytes], sig: int) -> tuple[int, float]:
    """Send `sig`; return the exit code and the seconds until the process ended."""
    sent = time.monotonic()
    proc.send_signal(sig)
    try:
        code = proc.wait(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        pytest.fail(f"still running {STOP_TIMEOUT_S:.0f}s after {signal.Signals(sig).name}")
    return code, time.monotonic() - sent


def force_down(state: Path | None) -> None:
    """After a failed test: leave nothing behind either way."""
    if state is None:
        return
    if state.exists():
        cluster.down(state)
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid() and (
                str(state) in _read(entry / "cmdline") or str(state) in _read(entry / "environ")):
            with contextlib.suppress(OSError):
                os.kill(int(entry.name), signal.SIGKILL)


@pytest.mark.long  # CI's demo (tests/e2e/test_demo.py) checks its teardown after a normal end
def test_sigterm_tears_down_the_demo_once_its_operator_runs(tmp_path: Path) -> None:
    state = tmp_path / "demo"
    log = tmp_path / "demo.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([*GEMINI, *DEMO_ARGS, "--state-dir", str(state)], cwd=REPO,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        # Cluster, S3, CRD and operator are up; the reference run still trains (or waits).
        wait_for(lambda: (state / "demo" / "operator.pid").exists(), UP_TIMEOUT_S,
                 "operator started by the demo", proc)
        net_octet = octet(state)
        assert net_octet is not None
        running = leftovers(state, net_octet)
        assert_seen_running(running)
        assert any("operator run" in line for line in running), running
        code, _ = stopped(proc, signal.SIGTERM)
        output = log.read_text(errors="replace")
        assert code == 143, output[-3000:]
        assert output.strip().splitlines()[-1].startswith("gemini demo: stopped by SIGTERM; "
                                                           "tore down"), output[-3000:]
        assert leftovers(state, net_octet) == []
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        force_down(state)


@pytest.mark.long  # a benchmark's clean-up, as the demo's above
def test_sigterm_to_the_recovery_bench_mid_bring_up_tears_down_its_demo(
        tmp_path: Path) -> None:
    """bench/recovery_downtime.py passes the signal on to the demo it runs, waits for its
    teardown, then makes sure its state dir is down and removes it."""
    log = tmp_path / "bench.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, str(REPO / "bench" / "recovery_downtime.py"), "--runs", "1",
             "--workers", "2", "--failures", "trainer-crash", "--tmp-dir", str(tmp_path)],
            cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    state: Path | None = None
    try:
        state = wait_for(lambda: next(iter(tmp_path.glob("gbench-*")), None), UP_TIMEOUT_S,
                         "state dir of the bench's demo", proc)
        assert state is not None
        # Mid bring-up: the API server answers and nodes register (S3 not up yet, mostly).
        wait_for(lambda: nodes_registered(state), UP_TIMEOUT_S, "registered node", proc)
        net_octet = octet(state)
        assert net_octet is not None
        assert_seen_running(leftovers(state, net_octet))
        code, _ = stopped(proc, signal.SIGTERM)
        output = log.read_text(errors="replace")
        assert code == 143, output[-3000:]
        assert "demo (exit 143): gemini demo: stopped by SIGTERM; tore down" in output, \
            output[-3000:]
        assert "recovery_downtime.py: stopped by SIGTERM" in output, output[-3000:]
        assert not state.exists()
        assert leftovers(state, net_octet) == []
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        force_down(state)
