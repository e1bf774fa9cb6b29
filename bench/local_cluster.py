"""Local cluster latencies: pod created -> Running, and node lost -> NotReady/Unknown.

Starts its own control plane and 4 nodes in a temporary directory, then measures (medians):
- pod created -> phase Running seen through the API (target <= 2 s on an idle cluster), next
  to the baseline of starting the same command as a plain process in this run;
- node lost (all its processes SIGKILLed) -> Node Ready condition Unknown/False seen through
  the API (target <= 10 s; KCM's node-monitor-grace-period is 8 s).
The last line is the JSON summary for pod -> Running; the line before it is node lost.

`--kubelet`: the same pod measure on one real kubelet node (kubelet, containerd, runc, bridge
CNI: gemini_local.kubelet) instead of the node agents, target <= 3 s (issue 15), next to the
baseline of the container runtime alone starting the same image (`ctr run -d` on the node's
containerd: no sandbox, no network, no API server). Needs root.
Ctrl-C or SIGTERM (a timeout) stops it cleanly: what it started is torn down (exit 130/143).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kubernetes import client, config
from support.cleanup import cleaning_up

from gemini_local import faults
from gemini_local.controlplane import start_control_plane, stop_control_plane
from gemini_local.nodes import (
    NodeSpec,
    start_node_agent,
    stop_all_node_agents,
    wait_for_node_agents,
)

POD_RUNS = 9
NODE_RUNS = 3
COMMAND = ["sleep", "300"]


def wait(predicate, timeout: float, interval: float = 0.01) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if predicate():
            return time.monotonic() - start
        time.sleep(interval)
    raise TimeoutError(f"condition not met in {timeout}s")


def ready_status(core: client.CoreV1Api, node: str) -> str:
    status = core.read_node(node).status
    for cond in (status.conditions if status else None) or []:
        if cond.type == "Ready":
            return str(cond.status)
    return "None"


def pod_to_running(core: client.CoreV1Api, i: int) -> float:
    body: Any = {"metadata": {"name": f"bench-{i}"}, "spec": {
        "terminationGracePeriodSeconds": 0,
        "containers": [{"name": "c", "image": "x", "command": COMMAND}]}}
    start = time.monotonic()
    core.create_namespaced_pod("default", body)
    wait(lambda: _phase(core, f"bench-{i}") == "Running", 30)
    elapsed = time.monotonic() - start
    core.delete_namespaced_pod(f"bench-{i}", "default")
    time.sleep(0.3)  # let the cluster go idle again
    return elapsed


def _phase(core: client.CoreV1Api, name: str) -> str | None:
    status = core.read_namespaced_pod(name, "default").status
    return status.phase if status else None


def process_start() -> float:
    start = time.monotonic()
    proc = subprocess.Popen(COMMAND)
    elapsed = time.monotonic() - start
    proc.kill()
    proc.wait()
    return elapsed


def node_lost(plane, core: client.CoreV1Api, index: int) -> float:
    spec = NodeSpec(f"bench-spare-{index}", zone="zone-0", rack="rack-0", index=index)
    faults.add_node(plane.kubeconfig, plane.pki, plane.state_dir, spec)
    wait(lambda: ready_status(core, spec.name) == "True", 20)
    time.sleep(2.5)  # a steady state: a few lease renewals seen by the controller manager
    start = time.monotonic()
    faults.lose_node(plane.state_dir, spec.name)
    wait(lambda: ready_status(core, spec.name) in ("Unknown", "False"), 30, interval=0.05)
    return time.monotonic() - start


def kubelet_pod_to_running(core: client.CoreV1Api, node: Any, i: int) -> float:
    """Pod created -> its container running (seen through the API) on the kubelet node."""
    from gemini_local.kubelet import PAUSE_IMAGE

    name = f"bench-kubelet-{i}"
    body: Any = {"metadata": {"name": name}, "spec": {
        "nodeName": node.name, "terminationGracePeriodSeconds": 0,
        "automountServiceAccountToken": False, "tolerations": [{"operator": "Exists"}],
        "containers": [{"name": "c", "image": PAUSE_IMAGE, "imagePullPolicy": "Never",
                        "args": [name]}]}}
    start = time.monotonic()
    core.create_namespaced_pod("default", body)
    wait(lambda: _phase(core, name) == "Running", 60)
    elapsed = time.monotonic() - start
    core.delete_namespaced_pod(name, "default", grace_period_seconds=0)
    wait(lambda: not core.list_namespaced_pod(
        "default", field_selector=f"metadata.name={name}").items, 60, interval=0.1)
    return elapsed


def runtime_start(node: Any, i: int) -> float:
    """The runtime alone: `ctr run -d` of the same image until its task runs."""
    from gemini_local.kubelet import PAUSE_IMAGE

    name = f"bench-ctr-{i}"
    start = time.monotonic()
    node.ctr("run", "-d", PAUSE_IMAGE, name, "/pause", name)
    elapsed = time.monotonic() - start
    node.ctr("tasks", "delete", "--force", name)  # kills the task first
    node.ctr("containers", "delete", name)
    return elapsed


def measure_kubelet(state_dir: Path) -> int:
    from gemini_local.kubelet import start_kubelet_node, stop_kubelet_node

    plane = start_control_plane(state_dir)
    try:
        node = start_kubelet_node(plane, state_dir / "kubelet-node")
        try:
            core = client.CoreV1Api(config.new_client_from_config(str(plane.kubeconfig)))
            time.sleep(1)
            pods = [kubelet_pod_to_running(core, node, i) for i in range(POD_RUNS)]
            base = [runtime_start(node, i) for i in range(POD_RUNS)]
        finally:
            problems = stop_kubelet_node(plane, node)
            if problems:
                print(f"the kubelet node's teardown left: {problems}", file=sys.stderr)
    finally:
        stop_control_plane(state_dir)
        shutil.rmtree(state_dir, ignore_errors=True)
    print(f"pod created -> Running on a real kubelet node (s): {[round(x, 3) for x in pods]}",
          file=sys.stderr)
    print(f"ctr run -d, the runtime alone (s): {[round(x, 3) for x in base]}", file=sys.stderr)
    pod, runtime = statistics.median(pods), statistics.median(base)
    print(json.dumps({"metric": "kubelet_pod_created_to_running_median", "value": round(pod, 3),
                      "target": 3.0, "better": "lower", "unit": "s",
                      "baseline_runtime_start_median_s": round(runtime, 3),
                      "ratio_to_runtime": round(pod / runtime, 2), "runs": POD_RUNS}))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kubelet", action="store_true",
                        help="measure pods on a real kubelet node (needs root)")
    args = parser.parse_args()
    with cleaning_up() as cleanup:
        state_dir = cleanup.cluster(Path(tempfile.mkdtemp(prefix="gemini-bench-")))
        return measure_kubelet(state_dir) if args.kubelet else measure(state_dir)


def measure(state_dir: Path) -> int:
    try:
        plane = start_control_plane(state_dir)
        specs = [NodeSpec(f"node-{i}", f"zone-{i // 2}", f"rack-{i % 2}", i) for i in range(4)]
        for spec in specs:
            start_node_agent(plane.kubeconfig, plane.pki, state_dir, spec)
        wait_for_node_agents(state_dir, [s.name for s in specs])
        core = client.CoreV1Api(config.new_client_from_config(str(plane.kubeconfig)))
        for spec in specs:
            wait(lambda s=spec: ready_status(core, s.name) == "True", 20)
        time.sleep(1)
        pods = [pod_to_running(core, i) for i in range(POD_RUNS)]
        base = [process_start() for _ in range(POD_RUNS)]
        lost = [node_lost(plane, core, 10 + i) for i in range(NODE_RUNS)]
    finally:
        stop_all_node_agents(state_dir)
        stop_control_plane(state_dir)
        shutil.rmtree(state_dir, ignore_errors=True)
    print(f"pod created -> Running (s): {[round(x, 3) for x in pods]}", file=sys.stderr)
    print(f"plain process start (s): {[round(x, 4) for x in base]}", file=sys.stderr)
    print(f"node lost -> NotReady (s): {[round(x, 2) for x in lost]}", file=sys.stderr)
    print(json.dumps({"metric": "node_lost_to_not_ready_median", "value": round(
        statistics.median(lost), 2), "target": 10.0, "better": "lower", "unit": "s",
        "runs": NODE_RUNS}))
    print(json.dumps({"metric": "pod_created_to_running_median", "value": round(
        statistics.median(pods), 3), "target": 2.0, "better": "lower", "unit": "s",
        "baseline_process_start_median_s": round(statistics.median(base), 4),
        "runs": POD_RUNS}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
