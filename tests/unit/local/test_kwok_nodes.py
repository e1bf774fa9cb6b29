"""The fake nodes' shape: topology spread, unique addresses, and what kwok needs to manage them."""

from __future__ import annotations

import sys
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path

import pytest

from gemini_local import kwok, processes
from gemini_local.controlplane import ControlPlane, Ports
from gemini_local.nodeagent.config import GPU_RESOURCE, RACK_LABEL, ZONE_LABEL
from gemini_local.pki import Pki


def test_nodes_spread_over_racks_and_zones_like_gemini_local() -> None:
    nodes = kwok.fake_nodes(1010, zones=3, racks=100)
    assert len({n.name for n in nodes}) == 1010
    assert len({n.ip for n in nodes}) == 1010
    racks = Counter(n.rack for n in nodes)
    assert len(racks) == 100 and set(racks.values()) == {10, 11}
    # A rack lives in exactly one zone.
    assert all(len({n.zone for n in nodes if n.rack == r}) == 1 for r in racks)
    assert Counter(n.zone for n in nodes) == {"zone-a": 344, "zone-b": 333, "zone-c": 333}


@pytest.mark.parametrize(("count", "zones", "racks"), [(0, 1, 1), (4, 2, 1), (4, 1, 5)])
def test_bad_topologies_are_refused(count: int, zones: int, racks: int) -> None:
    with pytest.raises(ValueError, match=r"must be|need"):
        kwok.fake_nodes(count, zones, racks)


def test_manifest_is_kwok_managed_ready_and_labelled() -> None:
    node = kwok.fake_nodes(5, zones=2, racks=3)[4]
    manifest = kwok.node_manifest(node, kwok.FakeNodeShape(gpus=4), datetime.now(UTC))
    meta, status = manifest["metadata"], manifest["status"]
    assert meta["annotations"] == {kwok.KWOK_ANNOTATION: kwok.KWOK_ANNOTATION_VALUE}
    assert meta["labels"]["kubernetes.io/hostname"] == node.name == "kwok-node-4"
    assert (meta["labels"][ZONE_LABEL], meta["labels"][RACK_LABEL]) == ("zone-b", "rack-1")
    assert status["allocatable"][GPU_RESOURCE] == "4" == status["capacity"][GPU_RESOURCE]
    ready = [c for c in status["conditions"] if c["type"] == "Ready"]
    assert [c["status"] for c in ready] == ["True"]
    assert {"type": "InternalIP", "address": node.ip} in status["addresses"]


def test_no_gpus_means_no_gpu_resource() -> None:
    assert GPU_RESOURCE not in kwok.FakeNodeShape(gpus=0).resources()


def test_kwok_runs_with_our_stages_and_lease() -> None:
    args = " ".join(kwok.kwok_args(Path("/bin"), Path("/kubeconfig"), Path("/c.yaml"), 1234))
    assert f"--config={kwok.STAGES}" in args
    assert f"--node-lease-duration-seconds={kwok.LEASE_SECONDS}" in args
    # kwok renews every duration/4; KCM must not call a node lost before two renewals fail.
    assert kwok.LEASE_SECONDS / 4 * 2 < kwok.NODE_MONITOR_GRACE_SECONDS
    assert kwok.STAGES.exists()


def test_a_longer_lease_gets_a_grace_of_three_leases() -> None:
    args = kwok.kwok_args(Path("/bin"), Path("/kubeconfig"), Path("/c.yaml"), 1234, 1200)
    assert "--node-lease-duration-seconds=1200" in args
    assert kwok.node_monitor_grace(1200) == 3600
    assert kwok.node_monitor_grace() == kwok.NODE_MONITOR_GRACE_SECONDS


@pytest.mark.parametrize(("grace", "lease"), [(8, kwok.LEASE_SECONDS), (120, 1200)])
def test_kwok_refuses_a_control_plane_that_would_call_its_nodes_lost(
    tmp_path: Path, grace: int, lease: int
) -> None:
    # A stand-in process with KCM's name and command line; start_kwok reads only those.
    argv = [sys.executable, "-c", "import time; time.sleep(60)",
            "--node-monitor-period=1s", f"--node-monitor-grace-period={grace}s"]
    processes.spawn("kube-controller-manager", argv, tmp_path / "pids", tmp_path / "logs")
    plane = ControlPlane(tmp_path, Ports(1, 2, 3, 4, 5), tmp_path / "kubeconfig",
                         Pki(tmp_path / "pki"))
    try:
        wanted = f"node_monitor_grace_seconds={kwok.node_monitor_grace(lease)}"
        with pytest.raises(kwok.KwokError, match=wanted):
            kwok.start_kwok(plane, tmp_path, lease_seconds=lease)
    finally:
        processes.stop("kube-controller-manager", tmp_path / "pids", grace_seconds=1)
