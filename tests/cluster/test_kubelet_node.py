"""A real kubelet node (kubelet + containerd + runc + bridge CNI) on the local control plane.

One node joins, becomes Ready and runs a real pod (the pause image, which prints its arguments
and then waits); its log comes back through the API server and the kubelet; a killed container
is restarted; the teardown leaves no daemon, mount, cgroup or changed sysctl behind.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client, config

from gemini_local.controlplane import ControlPlane
from gemini_local.kubelet import (
    PAUSE_IMAGE,
    KubeletNode,
    mounts_under,
    start_kubelet_node,
    stop_kubelet_node,
)
from gemini_local.kubelet.host import cgroup_dirs
from gemini_local.kubelet.node import BRIDGE_PREFIX
from tests.fixtures import kubelet_host
from tests.fixtures.nodes import wait_until

pytestmark = pytest.mark.cluster

MESSAGE = "hello from a real kubelet"


@pytest.fixture(scope="module")
def kubelet_node(control_plane: ControlPlane,
                 tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    before = kubelet_host.host_before_nodes()
    state_dir = tmp_path_factory.mktemp("kubelet-node")
    started = time.monotonic()
    node = start_kubelet_node(control_plane, state_dir)
    info: dict[str, Any] = {"node": node, "before": before, "state_dir": state_dir,
                            "ready_s": time.monotonic() - started}
    try:
        yield info
    finally:
        info["problems"] = stop_kubelet_node(control_plane, node)


@pytest.fixture(scope="module")
def core(control_plane: ControlPlane) -> client.CoreV1Api:
    return client.CoreV1Api(config.new_client_from_config(str(control_plane.kubeconfig)))


def _pod(name: str, node: KubeletNode) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
            "spec": {
                "nodeName": node.name, "automountServiceAccountToken": False,
                "terminationGracePeriodSeconds": 2, "restartPolicy": "Always",
                "tolerations": [{"operator": "Exists"}],
                "containers": [{"name": "main", "image": PAUSE_IMAGE,
                                "imagePullPolicy": "Never", "args": [MESSAGE, name]}]}}


def _container_status(core: client.CoreV1Api, name: str) -> Any:
    pod = core.read_namespaced_pod(name, "default")
    statuses = pod.status.container_statuses or []
    return statuses[0] if statuses else None


def _container_pids(marker: str) -> list[int]:
    """Pids of the pause processes started with `marker` as an argument (our container)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if argv[0] == "/pause" and marker in argv:
            pids.append(int(proc.name))
    return pids


def test_real_pod_runs_logs_and_restarts_on_a_kubelet_node(kubelet_node, core, control_plane):
    node: KubeletNode = kubelet_node["node"]
    print(f"node {node.name} Ready {kubelet_node['ready_s']:.1f} s after the start")
    ready = core.read_node(node.name)
    addresses = {a.type: a.address for a in ready.status.addresses}
    assert addresses.get("InternalIP") == node.name, addresses

    name = "kubelet-hello"
    core.create_namespaced_pod("default", _pod(name, node))
    started = time.monotonic()
    try:
        def running() -> bool:
            status = _container_status(core, name)
            return bool(status and status.state.running and status.ready)

        wait_until(running, 120, f"pod {name} Running on {node.name} (see "
                   f"{node.log_dir}/kubelet.log and containerd.log)", interval=0.5)
        print(f"pod Running {time.monotonic() - started:.1f} s after its creation")
        assert core.read_namespaced_pod(name, "default").status.phase == "Running"

        # The log comes from the kubelet (API server -> kubelet on the node's InternalIP).
        wait_until(lambda: MESSAGE in core.read_namespaced_pod_log(name, "default"), 30,
                   "the container's line in its log", interval=0.5)

        pids = wait_until(lambda: _container_pids(name), 10, "the container's process")
        assert len(pids) == 1, pids
        os.kill(pids[0], signal.SIGKILL)

        def restarted() -> bool:
            status = _container_status(core, name)
            return bool(status and status.restart_count >= 1 and status.state.running)

        wait_until(restarted, 120, f"the kubelet to restart the killed container of {name}",
                   interval=0.5)
        new_pids = wait_until(lambda: _container_pids(name), 30, "the restarted process")
        assert new_pids != pids
        wait_until(lambda: MESSAGE in core.read_namespaced_pod_log(name, "default"), 30,
                   "the restarted container's line in its log", interval=0.5)
    finally:
        core.delete_namespaced_pod(name, "default", grace_period_seconds=1)
    wait_until(lambda: not _container_pids(name), 60, "the pod's process to end", interval=0.5)


def test_teardown_leaves_nothing_behind(kubelet_node, control_plane):
    """Runs last in this module: tears the node down itself and checks the host."""
    node: KubeletNode = kubelet_node["node"]
    problems = stop_kubelet_node(control_plane, node)
    assert problems == [], problems
    assert node.running_pids() == {"containerd": None, "kubelet": None}
    shims = kubelet_host.processes_naming(str(node.containerd_socket).encode())
    assert shims == [], "processes still using the node's containerd socket"
    assert mounts_under(kubelet_node["state_dir"]) == []
    assert not Path(f"/sys/class/net/{BRIDGE_PREFIX}0").exists()
    assert [d for d in cgroup_dirs() if d.exists()] == []
    assert kubelet_host.snapshot() == kubelet_node["before"]
