"""Fake nodes at scale with kwok: thousands of Nodes and their pods, no processes.

kwok (sigs.k8s.io/kwok, built by hack/build-kwok.sh) runs as one detached process against a
control plane from `start_control_plane`. It manages only Nodes annotated
`kwok.x-k8s.io/node: fake` and plays the Stages in hack/kwok/stages.yaml: such nodes become
Ready (with a Lease renewed every 10 s), pods bound to them become Running and Ready with a
pod IP, and deleted pods are finalized. Scale tests of the operator use it; nothing runs.

A node is "lost" with `kwok_lose_node`: it is labelled so the Stages leave it and its pods
alone, and its conditions and taints become what kube-controller-manager writes for a silent
kubelet; KCM then evicts its pods, which stay Terminating.
"""

from __future__ import annotations

import ipaddress
import json
import shutil
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from gemini_local import controlplane, processes
from gemini_local.controlplane import REPO_ROOT, ControlPlane, cache_root
from gemini_local.nodeagent.config import GPU_RESOURCE, RACK_LABEL, ZONE_LABEL

BUILD_SCRIPT = REPO_ROOT / "hack" / "build-kwok.sh"
STAGES = REPO_ROOT / "hack" / "kwok" / "stages.yaml"
KWOK_ANNOTATION = "kwok.x-k8s.io/node"
KWOK_ANNOTATION_VALUE = "fake"
# Nodes and pods with this label are skipped by every Stage (see hack/kwok/stages.yaml).
LOST_LABEL = "gemini.io/kwok-lost"
FAKE_NODE_LABEL = "node.gemini.io/kwok"
# Pod IPs come from here, unique across nodes: loopback, so that a connection to a fake pod
# (an operator calling its sidecar) is refused at once instead of leaving the machine; outside
# the node agents' 127.100-199.x.x (gemini_local.nodeagent.addressing).
POD_CIDR = "127.64.0.0/16"
# kwok renews each Lease every duration/4 = 10 s (a kubelet's defaults); KCM must wait longer
# than that before it calls a node Unknown. Its usual 8 s (controlplane.py) is too short here:
# renewing a thousand leases that often costs the API server 200+ writes/s, and on a busy
# machine the backlog made KCM evict pods from healthy fake nodes (seen).
# Still too short with other work loading the machine (load 12-16 on 2 cores): leases fell
# 40 s behind and KCM's taint eviction deleted pods of healthy fake nodes (seen). Nothing
# waits on KCM's grace (`kwok_lose_node` writes a loss itself), so it is generous.
LEASE_SECONDS = 40
NODE_MONITOR_GRACE_SECONDS = 120
# Thousands of nodes: 8,192 leases renewed every 10 s are 800 writes/s, more than an API
# server on 2 cores takes, so renewals fall behind and healthy nodes are called lost (seen in
# an 8,192-rank try). A longer lease (renewed every quarter of it) with a grace of 3 leases
# keeps them Ready.


def node_monitor_grace(lease_seconds: int = LEASE_SECONDS) -> int:
    """The KCM grace period kwok's nodes need when their leases last `lease_seconds`."""
    return max(NODE_MONITOR_GRACE_SECONDS, 3 * lease_seconds)

# Node addresses: unique, loopback like the pods' (nothing listens there).
_NODE_NET = ipaddress.IPv4Address("127.65.0.0")
_NAME = "kwok"
_UNREACHABLE = "node.kubernetes.io/unreachable"
_UNKNOWN_MESSAGE = "Kubelet stopped posting node status."
# What kwok's node-initialize Stage writes, written at creation instead.
_HEALTHY = (
    ("Ready", "True", "KubeletReady", "kubelet is posting ready status"),
    ("MemoryPressure", "False", "KubeletHasSufficientMemory",
     "kubelet has sufficient memory available"),
    ("DiskPressure", "False", "KubeletHasNoDiskPressure", "kubelet has no disk pressure"),
    ("PIDPressure", "False", "KubeletHasSufficientPID", "kubelet has sufficient PID available"),
)
_NODE_CONDITIONS = tuple(kind for kind, *_ in _HEALTHY)


class KwokError(RuntimeError):
    """kwok cannot be built, started or reached; the message says why."""


@dataclass(frozen=True)
class FakeNodeShape:
    """What each fake node offers the scheduler (capacity == allocatable)."""

    cpu: str = "64"
    memory: str = "512Gi"
    pods: int = 110
    gpus: int = 8

    def resources(self) -> dict[str, str]:
        res = {"cpu": self.cpu, "memory": self.memory, "pods": str(self.pods),
               "ephemeral-storage": "1Ti"}
        if self.gpus:
            res[GPU_RESOURCE] = str(self.gpus)
        return res


@dataclass(frozen=True)
class FakeNode:
    name: str
    zone: str
    rack: str
    ip: str


def kwok_bin_dir() -> Path:
    """Directory holding the cached kwok binary, building it first when missing."""
    if shutil.which("go") is None and not _cached_kwok():
        raise KwokError("kwok is not built and Go is not installed: install Go >= 1.26 "
                        f"(e.g. apt-get install golang-go), then run {BUILD_SCRIPT}")
    return controlplane.built(BUILD_SCRIPT, "kwok", KwokError)


def _cached_kwok() -> bool:
    return any(p.joinpath("kwok").exists() for p in (cache_root() / "bin").glob("kwok-*"))


def kwok_config(parallelism: int = 16) -> str:
    """kwok's own options that have no flag: more workers than its default 4 for 1000 nodes."""
    return json.dumps({
        "apiVersion": "config.kwok.x-k8s.io/v1alpha1", "kind": "KwokConfiguration",
        "options": {"nodeLeaseParallelism": parallelism, "nodePlayStageParallelism": parallelism,
                    "podPlayStageParallelism": parallelism},
    })


def kwok_args(bin_dir: Path, kubeconfig: Path, config: Path, port: int,
              lease_seconds: int = LEASE_SECONDS) -> list[str]:
    return [
        str(bin_dir / "kwok"), f"--kubeconfig={kubeconfig}",
        f"--config={config}", f"--config={STAGES}",
        "--manage-all-nodes=false",
        f"--manage-nodes-with-annotation-selector={KWOK_ANNOTATION}={KWOK_ANNOTATION_VALUE}",
        f"--node-lease-duration-seconds={lease_seconds}", f"--cidr={POD_CIDR}",
        # Its health endpoint, served once its controllers have started (loopback only).
        f"--server-address=127.0.0.1:{port}", "--v=WARN",
    ]


def start_kwok(plane: ControlPlane, state_dir: Path, timeout: float = 60.0,
               lease_seconds: int = LEASE_SECONDS) -> int:
    """Start kwok against `plane`, its pid, log and config under `state_dir`; return its pid.

    Returns once kwok's controllers run. Start `plane` with
    `node_monitor_grace_seconds=node_monitor_grace(lease_seconds)`, or KCM may take busy fake
    nodes for lost ones.
    """
    pid_dir, log_dir = state_dir / "pids", state_dir / "logs"
    if processes.running_pid(_NAME, pid_dir) is not None:
        raise KwokError(f"kwok is already running for {state_dir}; stop_kwok() it first")
    grace, needed = _node_monitor_grace(plane), node_monitor_grace(lease_seconds)
    if grace is not None and grace < needed:
        raise KwokError(
            f"kube-controller-manager calls a node lost after {grace} s of silence, but kwok "
            f"renews leases every {lease_seconds // 4} s: start the control plane with "
            f"node_monitor_grace_seconds={needed} "
            "(gemini_local.kwok.start_kwok_cluster does)")
    bin_dir = kwok_bin_dir()
    state_dir.mkdir(parents=True, exist_ok=True)
    config = state_dir / "kwok-config.yaml"
    config.write_text(kwok_config())
    port = processes.free_port()
    argv = kwok_args(bin_dir, plane.kubeconfig, config, port, lease_seconds)
    pid = processes.spawn(_NAME, argv, pid_dir, log_dir)
    log = log_dir / f"{_NAME}.log"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if processes.running_pid(_NAME, pid_dir) is None:
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-10:])
            raise KwokError(f"kwok exited during start-up; end of {log}:\n{tail}")
        if _healthy(port):
            return pid
        time.sleep(0.2)
    stop_kwok(state_dir)
    raise KwokError(f"kwok not healthy after {timeout:.0f}s; see {log}")


def _node_monitor_grace(plane: ControlPlane) -> int | None:
    """KCM's --node-monitor-grace-period in seconds, read from its command line."""
    pid = processes.running_pid("kube-controller-manager", plane.pid_dir)
    if pid is None:
        return None
    for arg in Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0"):
        if arg.startswith("--node-monitor-grace-period=") and arg.endswith("s"):
            return int(arg.split("=", 1)[1][:-1])
    return None


def _healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as resp:
            return bool(resp.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def stop_kwok(state_dir: Path) -> bool:
    """Stop kwok; False if it was not running. The fake nodes stay (their leases lapse)."""
    return processes.stop(_NAME, state_dir / "pids")


def fake_nodes(count: int, zones: int, racks: int, prefix: str = "kwok-node") -> list[FakeNode]:
    """`count` nodes: node i in rack i % racks, rack r in zone r % zones (as `gemini local`)."""
    if count < 1 or count > 65000:
        raise ValueError(f"count must be between 1 and 65000, got {count}")
    if not 1 <= zones <= racks <= count:
        raise ValueError(f"need 1 <= zones ({zones}) <= racks ({racks}) <= count ({count})")
    nodes = []
    for i in range(count):
        rack = i % racks
        ip = str(_NODE_NET + i + 1)
        nodes.append(FakeNode(f"{prefix}-{i}", _zone_name(rack % zones), f"rack-{rack}", ip))
    return nodes


def _zone_name(index: int) -> str:
    return f"zone-{chr(ord('a') + index)}" if index < 26 else f"zone-{index}"


def node_manifest(node: FakeNode, shape: FakeNodeShape, now: datetime) -> dict[str, Any]:
    """A Node kwok manages, created Ready (status may be set on create, as a kubelet does).

    Created without a Ready condition, KCM would first taint it not-ready and then have to
    lift a thousand taints through its rate-limited client (minutes at this scale).
    """
    resources = shape.resources()
    stamp = now.strftime("%Y-%m-%dT%H:%M:%SZ")
    return {
        "apiVersion": "v1", "kind": "Node",
        "metadata": {
            "name": node.name,
            "annotations": {KWOK_ANNOTATION: KWOK_ANNOTATION_VALUE},
            "labels": {
                "kubernetes.io/hostname": node.name, "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64", "type": "kwok",
                ZONE_LABEL: node.zone, RACK_LABEL: node.rack, FAKE_NODE_LABEL: "true",
            },
        },
        "spec": {},
        "status": {
            "capacity": resources, "allocatable": resources,
            "addresses": [{"type": "InternalIP", "address": node.ip},
                          {"type": "Hostname", "address": node.name}],
            "conditions": [
                {"type": kind, "status": status, "reason": reason, "message": message,
                 "lastHeartbeatTime": stamp, "lastTransitionTime": stamp}
                for kind, status, reason, message in _HEALTHY],
            "nodeInfo": {
                "architecture": "amd64", "operatingSystem": "linux", "bootID": "",
                "machineID": "", "systemUUID": "", "osImage": "kwok",
                "kernelVersion": "kwok", "containerRuntimeVersion": "kwok",
                "kubeletVersion": "kwok", "kubeProxyVersion": "kwok",
            },
            "phase": "Running",
        },
    }


def core_api(kubeconfig: Path, pool: int = 32) -> Any:
    """A CoreV1Api with `pool` connections (this module reads raw JSON: `_preload_content`)."""
    from kubernetes import client, config

    cfg = client.Configuration()
    config.load_kube_config(config_file=str(kubeconfig), client_configuration=cfg)
    cfg.connection_pool_maxsize = pool
    return client.CoreV1Api(client.ApiClient(cfg))


def _parallel(fn: Callable[[Any], None], items: Iterable[Any], workers: int) -> None:
    with ThreadPoolExecutor(max_workers=workers) as pool:
        for _ in pool.map(fn, items):
            pass


def create_fake_nodes(
    kubeconfig: Path, count: int, zones: int, racks: int,
    shape: FakeNodeShape | None = None, prefix: str = "kwok-node", workers: int = 16,
) -> list[FakeNode]:
    """Create `count` kwok-managed Nodes (existing ones are kept); return them.

    They become Ready once kwok plays node-initialize on them: `wait_nodes_ready`.
    """
    from kubernetes.client.exceptions import ApiException

    nodes = fake_nodes(count, zones, racks, prefix)
    core = core_api(kubeconfig, pool=workers)
    shape = shape or FakeNodeShape()
    now = datetime.now(UTC)

    def create(node: FakeNode) -> None:
        try:
            core.create_node(node_manifest(node, shape, now), _preload_content=False)
        except ApiException as err:
            if err.status != 409:
                raise KwokError(f"creating node {node.name} failed: {err.status} {err.reason}: "
                                f"{err.body}") from err
            return  # an existing node is left as it is
        # The API server's TaintNodesByCondition admission taints every new Node not-ready;
        # KCM lifts it from Ready nodes, but only a few a second through its rate-limited
        # client (minutes for a thousand). Lifting it here is what KCM would do, sooner.
        _untaint(core, node.name)

    _parallel(create, nodes, workers)
    return nodes


def _untaint(core: Any, name: str) -> None:
    # A fresh node's only taint is that one (KCM adds others only after a lease lapses).
    core.patch_node(name, {"spec": {"taints": None}}, _preload_content=False)


def delete_fake_nodes(kubeconfig: Path, names: Sequence[str], workers: int = 16) -> None:
    from kubernetes.client.exceptions import ApiException

    core = core_api(kubeconfig, pool=workers)

    def delete(name: str) -> None:
        try:
            core.delete_node(name, _preload_content=False)
        except ApiException as err:
            if err.status != 404:
                raise

    _parallel(delete, names, workers)


def ready_node_names(kubeconfig: Path) -> set[str]:
    """Names of the kwok nodes whose Ready condition is True and that are not tainted."""
    core = core_api(kubeconfig, pool=2)
    resp = core.list_node(label_selector=f"{FAKE_NODE_LABEL}=true", _preload_content=False)
    ready = set()
    for node in json.loads(resp.data)["items"]:
        conditions = node.get("status", {}).get("conditions") or []
        taints = node.get("spec", {}).get("taints") or []
        if not taints and any(c["type"] == "Ready" and c["status"] == "True"
                              for c in conditions):
            ready.add(node["metadata"]["name"])
    return ready


def wait_nodes_ready(kubeconfig: Path, names: Iterable[str], timeout: float = 120.0) -> float:
    """Wait until every named node is Ready and untainted; return the seconds waited."""
    want, start = set(names), time.monotonic()
    missing = want
    while time.monotonic() - start < timeout:
        missing = want - ready_node_names(kubeconfig)
        if not missing:
            return time.monotonic() - start
        time.sleep(0.5)
    sample = ", ".join(sorted(missing)[:5])
    raise KwokError(f"{len(missing)} of {len(want)} fake nodes not Ready after {timeout:.0f}s "
                    f"(e.g. {sample}); is kwok running? see its log under the state dir")


def kwok_lose_node(kubeconfig: Path, name: str) -> datetime:
    """Lose fake node `name` as a dead machine is lost; return when its loss was written.

    kwok keeps renewing the node's Lease (it cannot be told to stop for one node), so this
    writes what KCM writes for a silent kubelet: every condition Unknown, then the unreachable
    NoSchedule and NoExecute taints (KCM adds them too, but its NoSchedule pass proved
    unreliable under load, and a replacement pod must never land on the lost node). KCM's
    taint eviction then deletes the pods after their 5 s toleration; they stay Terminating, as
    on a real lost node, until deleted with grace 0.
    """
    core = core_api(kubeconfig, pool=2)
    label = {"metadata": {"labels": {LOST_LABEL: "true"}}}
    core.patch_node(name, label, _preload_content=False)
    for namespace, pod in _pods_on(core, name):
        core.patch_namespaced_pod(pod, namespace, label, _preload_content=False)
    now = datetime.now(UTC)
    stamp = now.strftime("%Y-%m-%dT%H:%M:%SZ")
    conditions = [{"type": kind, "status": "Unknown", "reason": "NodeStatusUnknown",
                   "message": _UNKNOWN_MESSAGE, "lastHeartbeatTime": stamp,
                   "lastTransitionTime": stamp} for kind in _NODE_CONDITIONS]
    core.patch_node_status(name, {"status": {"conditions": conditions}}, _preload_content=False)
    _edit_taints(core, name, lambda taints: [t for t in taints if t["key"] != _UNREACHABLE] + [
        {"key": _UNREACHABLE, "effect": "NoSchedule"},
        {"key": _UNREACHABLE, "effect": "NoExecute", "timeAdded": stamp}])
    return now


def kwok_restore_node(kubeconfig: Path, name: str) -> None:
    """Bring a lost fake node back: kwok makes it Ready again; its taints are lifted.

    Pods left Terminating on it are finalized by kwok once their label is gone.
    """
    core = core_api(kubeconfig, pool=2)
    unlabel = {"metadata": {"labels": {LOST_LABEL: None}}}
    for namespace, pod in _pods_on(core, name):
        core.patch_namespaced_pod(pod, namespace, unlabel, _preload_content=False)
    core.patch_node(name, unlabel, _preload_content=False)
    _edit_taints(core, name, lambda taints: [t for t in taints if t["key"] != _UNREACHABLE])


def _pods_on(core: Any, node: str) -> list[tuple[str, str]]:
    resp = core.list_pod_for_all_namespaces(field_selector=f"spec.nodeName={node}",
                                            _preload_content=False)
    return [(p["metadata"]["namespace"], p["metadata"]["name"])
            for p in json.loads(resp.data)["items"]]


def _edit_taints(core: Any, name: str, edit: Callable[[list[dict[str, Any]]], list[Any]],
                 attempts: int = 20) -> None:
    """Replace the node's taints with `edit(taints)`, retrying when someone else wrote first."""
    from kubernetes.client.exceptions import ApiException

    for _ in range(attempts):
        node = json.loads(core.read_node(name, _preload_content=False).data)
        taints = node["spec"].get("taints") or []
        try:
            core.patch_node(name, [
                {"op": "test", "path": "/metadata/resourceVersion",
                 "value": node["metadata"]["resourceVersion"]},
                {"op": "add", "path": "/spec/taints", "value": edit(taints)}],
                _preload_content=False)
            return
        except ApiException as err:
            if err.status not in (409, 422):  # 422: the test failed, the node changed
                raise
    raise KwokError(f"could not update the taints of node {name}: it kept changing")

def start_kwok_cluster(state_dir: Path, lease_seconds: int = LEASE_SECONDS) -> ControlPlane:
    """A control plane for fake nodes (KCM's grace fitted to kwok's leases) and kwok on it."""
    from gemini_local.controlplane import start_control_plane, stop_control_plane

    grace = node_monitor_grace(lease_seconds)
    plane = start_control_plane(state_dir, node_monitor_grace_seconds=grace)
    try:
        start_kwok(plane, state_dir, lease_seconds=lease_seconds)
    except BaseException:
        stop_control_plane(state_dir)
        raise
    return plane


def stop_kwok_cluster(state_dir: Path) -> None:
    from gemini_local.controlplane import stop_control_plane

    stop_kwok(state_dir)
    stop_control_plane(state_dir)
