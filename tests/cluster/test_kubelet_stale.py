"""Kubelet nodes of a run killed before its teardown (its daemons and containers SIGKILLed, as
when a CI session ends) leave the bridge, mounts, network namespaces, cgroups and sysctls
behind; the next start undoes them first, while a set whose daemons still run is refused.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from kubernetes import client, config

from gemini_local.controlplane import ControlPlane
from gemini_local.kubelet import (
    PAUSE_IMAGE,
    KubeletNodeError,
    lose_kubelet_node,
    mounts_under,
    start_kubelet_node,
    stop_kubelet_node,
)
from gemini_local.kubelet.node import BRIDGE_PREFIX, CLAIM
from tests.fixtures import kubelet_host
from tests.fixtures.nodes import wait_until

pytestmark = pytest.mark.cluster


def _pause_pod(name: str, node: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
            "spec": {"nodeName": node, "automountServiceAccountToken": False,
                     "terminationGracePeriodSeconds": 1,
                     "containers": [{"name": "main", "image": PAUSE_IMAGE,
                                     "imagePullPolicy": "Never", "args": [name]}]}}


def _running(core: client.CoreV1Api, name: str) -> bool:
    pod = core.read_namespaced_pod(name, "default")
    return any(s.state.running for s in pod.status.container_statuses or [])


def test_a_killed_runs_nodes_are_cleaned_up_by_the_next_start(control_plane: ControlPlane,
                                                              tmp_path: Path) -> None:
    before = kubelet_host.host_before_nodes()
    core = client.CoreV1Api(config.new_client_from_config(str(control_plane.kubeconfig)))
    killed = start_kubelet_node(control_plane, tmp_path / "killed")
    try:
        core.create_namespaced_pod("default", _pause_pod("stale-pod", killed.name))
        wait_until(lambda: _running(core, "stale-pod"), 120, "the pod Running", interval=0.5)
    finally:
        lose_kubelet_node(killed)  # the run dies here: nothing is cleaned up
    assert Path(f"/sys/class/net/{BRIDGE_PREFIX}0").exists()
    assert mounts_under(killed.state_dir), "a killed node leaves its mounts"
    assert kubelet_host.snapshot() != before, "a killed node leaves sysctls or paths changed"

    core.delete_namespaced_pod("stale-pod", "default", grace_period_seconds=0)
    node = start_kubelet_node(control_plane, tmp_path / "next")  # refused before the reclaim
    try:
        assert mounts_under(killed.state_dir) == []
        assert CLAIM.read_text().strip() == str((tmp_path / "next").resolve())
        with pytest.raises(KubeletNodeError, match="run on this machine"):
            start_kubelet_node(control_plane, tmp_path / "third", index=1)
        assert node.running_pids()["kubelet"] is not None, "a refused start stopped the node"
    finally:
        problems = stop_kubelet_node(control_plane, node)
    assert problems == [], problems
    assert not CLAIM.exists()
    assert kubelet_host.snapshot() == before
