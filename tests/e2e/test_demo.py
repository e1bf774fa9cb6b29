"""`gemini demo --output json` end to end: a small job on the local cluster (real kubelet nodes,
or node agents) through a trainer crash, a node loss and a whole placement group's loss, every
one recovered with the losses of an uninterrupted run."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

from gemini_demo.plan import DemoConfig, trainer_args
from gemini_demo.reference import ReferenceRun

REPO = Path(__file__).resolve().parents[2]
# An S3 checkpoint every 5 s rather than the demo's 30: the group loss restores a step near
# the one it lost, and the demo needs fewer steps (its budget waits 1.5 intervals for S3).
FAST_S3 = ("--persist-interval", "5")



def recoveries(report: dict) -> str:
    """Each failure's recovery and those no failure asked for, for an assertion's message.
    Unplanned ones do not fail the test (its failures were each recovered from the right
    tier, the losses say the rest) but show in the run's warnings summary."""
    rows = [(f["kind"], f["source"], f["operator_recovery"].get("epoch"),
             f["operator_recovery"].get("message")) for f in report["failures"]]
    if report["unplanned_recoveries"]:
        warnings.warn(f"recoveries no failure asked for: {report['unplanned_recoveries']}",
                      stacklevel=2)
    return f"recoveries {rows}; unplanned {report['unplanned_recoveries']}"


def assert_resumed_at_the_restored_steps(report: dict) -> None:
    """Each failure's restore, from the trainer's own log (rank 0's): it says it restored the
    step the operator restored, and its next step is the one after it (a rerun from step 0,
    whose losses also equal the reference, fails here)."""
    for failure in report["failures"]:
        restored = failure["operator_recovery"].get("restoredStep")
        said = f"{failure['kind']}: {failure}"
        assert restored is not None and failure["trainer_restored_step"] == restored, said
        assert failure["resumed_at_step"] == restored + 1, said


@pytest.fixture
def demo_dir() -> Iterator[Path]:
    # Short: the control plane's unix sockets live under it.
    path = Path(tempfile.mkdtemp(prefix="gdemo-", dir="/tmp"))
    yield path
    subprocess.run([sys.executable, "-m", "gemini_cli", "local", "--state-dir", str(path),
                    "down"], cwd=REPO, capture_output=True, check=False)
    shutil.rmtree(path, ignore_errors=True)


# CI: a crash and a node loss (the group loss from S3 is CI's in test_kubelet_nodes.py's S3
# case); all three in ./dev long.
DEMO_FAILURES = [pytest.param(["trainer-crash", "node-loss"], id="crash-node-loss"),
                 pytest.param(["trainer-crash", "node-loss", "group-loss"],
                              marks=pytest.mark.long, id="with-group-loss")]


@pytest.mark.e2e
@pytest.mark.kubelet
@pytest.mark.proves("demo", "two-procs-per-node", "trainer-crash", "node-loss")
@pytest.mark.parametrize("failures", DEMO_FAILURES)
def test_the_demo_on_kubelet_nodes_recovers_every_failure_with_the_reference_losses(
        demo_dir: Path, failures: list[str]) -> None:
    """`gemini demo --kubelet --procs-per-node 2`: real kubelets running the sidecar and
    examples images built from the Dockerfile, two training processes (ranks) per worker pod
    (node agents run this checkout: the tests below); each restore seen in rank 0's own log."""
    if os.geteuid() != 0:
        pytest.skip("real kubelet nodes need root")
    plot = demo_dir / "demo.png"
    result = subprocess.run(
        # No warm standby: the demo would wait for it before the crash (about 60 steps); the
        # FSDP example's case in test_kubelet_nodes.py proves a crash run in one.
        [sys.executable, "-m", "gemini_cli", "demo", "--kubelet", "--workers", "2",
         "--procs-per-node", "2", "--no-warm-standby", "--replicas", "2", "--model-size", "tiny",
         "--failures", ",".join(failures), *FAST_S3,
         "--state-dir", str(demo_dir), "--plot", str(plot), "--output", "json"],
        cwd=REPO, capture_output=True, text=True, timeout=900, check=False)
    # The error report (timeline, operator log, conditions) follows the progress lines.
    start = result.stderr.rfind("error: the demo failed")
    error = result.stderr[start:] if start >= 0 else result.stderr[-8000:]
    assert result.returncode == 0, f"stderr:\n{error[:12000]}\nstdout:\n{result.stdout}"
    report = json.loads(result.stdout)
    print(result.stderr[-3000:])
    print(json.dumps(report, indent=2))
    assert report["iteration_seconds"] > 0
    assert report["procs_per_node"] == 2
    assert report["losses_match"] is True
    kinds = [f["kind"] for f in report["failures"]]
    assert kinds == failures
    for failure in report["failures"]:
        assert failure["downtime_seconds"] is not None and failure["downtime_seconds"] > 0
        assert failure["losses_match"] is True, failure
        assert failure["source"] in ("local", "peer", "s3"), failure
        if failure["source"] in ("local", "peer"):
            assert failure["steps_lost"] <= 1, failure
    said = recoveries(report)
    assert report["failures"][0]["source"] in ("local", "peer"), said
    assert report["failures"][1]["source"] == "peer", said  # the lost node's shards
    if "group-loss" in failures:  # the whole group's holders gone: only S3 has that shard
        assert report["failures"][2]["source"] == "s3", said
    assert_resumed_at_the_restored_steps(report)
    assert plot.stat().st_size > 10_000
    # Torn down: nothing of the demo's cluster still runs.
    status = subprocess.run([sys.executable, "-m", "gemini_cli", "local", "--state-dir",
                             str(demo_dir), "status", "--output", "json"], cwd=REPO,
                            capture_output=True, text=True, check=False)
    assert json.loads(status.stdout)["running"] is False, status.stdout


@pytest.mark.e2e
@pytest.mark.long  # node agents, every engine: the kubelet demo above proves two per node in CI
@pytest.mark.proves("two-procs-per-node")
@pytest.mark.parametrize("engine", ["fsdp2", "deepspeed", "zero2"])
def test_two_processes_per_node_recover_every_failure_with_the_reference_losses(
        engine: str, demo_dir: Path) -> None:
    """numProcPerNode 2 on 2 nodes (4 ranks): a trainer crash restores both local shards from
    the node's memory, a node loss fetches both from the peer, the group loss both from S3."""
    result = subprocess.run(
        [sys.executable, "-m", "gemini_cli", "demo", "--workers", "2", "--replicas", "2",
         "--procs-per-node", "2", "--engine", engine, "--model-size", "tiny",
         "--failures", "trainer-crash,node-loss,group-loss", *FAST_S3,
         "--state-dir", str(demo_dir),
         "--output", "json"],
        cwd=REPO, capture_output=True, text=True, timeout=900, check=False)
    start = result.stderr.rfind("error: the demo failed")
    error = result.stderr[start:] if start >= 0 else result.stderr[-8000:]
    assert result.returncode == 0, f"stderr:\n{error[:12000]}\nstdout:\n{result.stdout}"
    report = json.loads(result.stdout)
    print(json.dumps(report, indent=2))
    assert (report["procs_per_node"], report["engine"]) == (2, engine)
    assert report["losses_match"] is True
    sources = [(f["kind"], f["source"]) for f in report["failures"]]
    said = recoveries(report)
    assert sources == [("trainer-crash", "local"), ("node-loss", "peer"), ("group-loss", "s3")], \
        said
    assert all(f["losses_match"] is True for f in report["failures"]), report["failures"]
    assert_resumed_at_the_restored_steps(report)


@pytest.mark.integration
@pytest.mark.long  # CI: every run through failures equals its reference run, bit for bit
def test_the_reference_run_is_deterministic_to_the_bit(tmp_path: Path) -> None:
    """Two reference runs side by side print the same loss at every step: what makes a
    comparison with the run through failures meaningful."""
    config = DemoConfig(workers=2, failures=("trainer-crash",), steps=11)
    args = trainer_args(config, with_sleep=False)
    script = REPO / "examples" / "train_gpt_zero3.py"
    runs = [ReferenceRun(script, args, 2, tmp_path / name).start() for name in ("a", "b")]
    try:
        first, second = (run.wait(timeout=600) for run in runs)
    finally:
        for run in runs:
            run.stop()
    assert sorted(first) == list(range(1, 12))
    assert first == second
