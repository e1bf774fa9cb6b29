"""The whole local cluster: control plane, nodes (process-running node agents, or real
kubelets with `kubelet=True`) and (optionally) S3, Kueue and monitoring (Prometheus and the
Prometheus Operator).

`up`, `down` and `status` are what `gemini local ...` and the test fixtures call. All state lives
in one directory (default ~/.gemini/local, or $GEMINI_LOCAL_DIR).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gemini_local import controlplane, processes
from gemini_local import images as images_mod
from gemini_local.controlplane import ControlPlane, ControlPlaneError
from gemini_local.nodeagent.config import RACK_LABEL, ZONE_LABEL

ATTACHED_PREFIX = "attached-"  # pid files of processes `down` stops first (see attach)
LOCAL_QUEUE = "local"  # with --with-kueue: the LocalQueue (in `default`) and its ClusterQueue
KUBELET_NODES = "kubelet-nodes"  # the state folder of real kubelet nodes (see gemini_local.kubelet)


def default_state_dir() -> Path:
    return Path(os.environ.get("GEMINI_LOCAL_DIR", Path.home() / ".gemini" / "local"))


@dataclass(frozen=True)
class Topology:
    """How many nodes, spread over racks, racks spread over zones (round robin)."""

    nodes: int = 4
    zones: int = 2
    racks: int = 2

    def __post_init__(self) -> None:
        if not 1 <= self.nodes <= 64:
            raise ValueError(f"--nodes must be between 1 and 64, got {self.nodes}")
        if not 1 <= self.zones <= self.racks:
            raise ValueError(
                f"--zones must be between 1 and --racks ({self.racks}), got {self.zones}"
            )
        if self.racks > self.nodes:
            raise ValueError(f"--racks ({self.racks}) cannot exceed --nodes ({self.nodes})")

    def node(self, index: int) -> tuple[str, str, str]:
        """(name, zone, rack) of node `index`: rack index % racks, in zone rack % zones."""
        rack = index % self.racks
        return f"node-{index}", f"zone-{chr(ord('a') + rack % self.zones)}", f"rack-{rack}"

    def labels(self, index: int) -> dict[str, str]:
        _, zone, rack = self.node(index)
        return {ZONE_LABEL: zone, RACK_LABEL: rack}


def up(state_dir: Path, topology: Topology, with_s3: bool = False,
       timeout: float = 60.0, with_kueue: bool = False, kubelet: bool = False,
       images: tuple[str, ...] = (), with_monitoring: bool = False) -> dict[str, Any]:
    """Start everything and wait until every node is Ready; return the cluster's description.

    `kubelet`: the nodes are real kubelets with containerd and runc (root only, one such
    cluster per machine) instead of node agents; `images`: the Dockerfile's targets (e.g.
    operator, sidecar) built (or taken from the cache) and imported into every kubelet node;
    `with_monitoring`: Prometheus, configured by the Prometheus Operator (gemini_local.monitoring).
    """
    if kubelet:
        _check_kubelet_nodes(topology)
    elif images:
        raise ControlPlaneError("images are for kubelet nodes (node agents run no images)")
    archives = _image_archives(images)  # before the cluster: a build takes a minute or two
    if controlplane.ControlPlane.load(state_dir) and any(
        controlplane.running_components(state_dir).values()
    ):
        raise ControlPlaneError(
            f"a local cluster is already running in {state_dir}; "
            "`gemini local status` shows it, `gemini local down` stops it"
        )
    shutil.rmtree(state_dir / "etcd-data", ignore_errors=True)
    shutil.rmtree(state_dir / "nodes", ignore_errors=True)
    _stop_kubelet_nodes(state_dir)  # left by a cluster that died without `down`
    started = time.monotonic()
    plane = controlplane.start_control_plane(state_dir, timeout=timeout)
    try:
        if kubelet:
            _start_kubelet_nodes(plane, state_dir, topology, timeout, archives)
        else:
            _start_node_agents(plane, state_dir, topology, timeout)
        pods_reach_host_at = _host_from_pods(state_dir, kubelet)
        s3 = _start_s3(state_dir, pods_reach_host_at) if with_s3 else None
        queue = _start_kueue(plane, state_dir) if with_kueue else None
        monitoring = _start_monitoring(plane, state_dir) if with_monitoring else None
    except BaseException:
        down(state_dir)
        raise
    info = {
        "stateDir": str(state_dir), "kubeconfig": str(plane.kubeconfig),
        "apiServer": plane.api_url, "topology": topology.__dict__,
        "nodeKind": "kubelet" if kubelet else "node-agent",
        "images": {t: images_mod.image_name(t) for t in images},
        "imageArchives": {t: str(a) for t, a in archives.items()}, "s3": s3,
        "hostFromPods": pods_reach_host_at,
        "kueue": queue, "monitoring": monitoring,
        "startupSeconds": round(time.monotonic() - started, 2),
    }
    (state_dir / "cluster.json").write_text(json.dumps(info, indent=2))
    return info


def _start_node_agents(plane: ControlPlane, state_dir: Path, topology: Topology,
                       timeout: float) -> None:
    from gemini_local import nodes

    for index in range(topology.nodes):
        name, zone, rack = topology.node(index)
        spec = nodes.NodeSpec(name=name, zone=zone, rack=rack, index=index)
        nodes.start_node_agent(plane.kubeconfig, plane.pki, state_dir, spec)
    _wait_nodes_ready(plane, topology.nodes, timeout)


def _check_kubelet_nodes(topology: Topology) -> None:
    from gemini_local.kubelet.node import MAX_NODES

    if os.geteuid() != 0:
        raise ControlPlaneError("--kubelet nodes need root (containerd, runc, cgroups, bridges)")
    if topology.nodes > MAX_NODES:
        raise ControlPlaneError(f"--kubelet: at most {MAX_NODES} nodes, not {topology.nodes}")


def _image_archives(targets: tuple[str, ...]) -> dict[str, Path]:
    try:
        return images_mod.archives(list(targets)) if targets else {}
    except images_mod.ImageError as err:
        raise ControlPlaneError(str(err)) from err


def _start_kubelet_nodes(plane: ControlPlane, state_dir: Path, topology: Topology,
                         timeout: float, archives: dict[str, Path]) -> None:
    from gemini_local import faults, kubelet
    from gemini_local.kubelet import seed

    labels = [topology.labels(i) for i in range(topology.nodes)]
    faults.track_kubelet_connections()  # before the kubelets connect: partitions need it
    # The images go into the seed store once; every node's containerd starts from hard links
    # to it. Where hard links cannot reach (another file system) each node imports them.
    linked = bool(archives) and seed.links_reach(state_dir)
    try:
        store = _seed(archives) if linked else None
        started = kubelet.start_kubelet_nodes(plane, state_dir / KUBELET_NODES, labels, timeout,
                                              images=store)
        if archives and not linked:
            with ThreadPoolExecutor(max_workers=len(started)) as pool:  # one containerd each
                list(pool.map(lambda node: _import_all(node, archives), started))
    except (kubelet.KubeletNodeError, seed.SeedError) as err:
        raise ControlPlaneError(str(err)) from err


def node_kind(state_dir: Path) -> str:
    """"kubelet" or "node-agent": what the cluster of `state_dir` was started with."""
    meta = state_dir / "cluster.json"
    return str(json.loads(meta.read_text()).get("nodeKind", "node-agent")) if meta.exists() \
        else "node-agent"


def add_kubelet_node(state_dir: Path, labels: dict[str, str] | None = None,
                     timeout: float = 120.0) -> str:
    """Start one more kubelet node (a spare) in the running kubelet cluster of `state_dir`, with
    the images the cluster started with, and wait until it is Ready; its name."""
    from gemini_local import kubelet
    from gemini_local.kubelet import seed

    plane = ControlPlane.load(state_dir)
    meta = state_dir / "cluster.json"
    if plane is None or not meta.exists():
        raise ControlPlaneError(f"no local cluster in {state_dir}; run `gemini local up` first")
    if node_kind(state_dir) != "kubelet":
        raise ControlPlaneError("this cluster runs node agents: add a node agent instead")
    info = json.loads(meta.read_text())
    root = state_dir / KUBELET_NODES
    index = max((n.index for n in kubelet.kubelet_nodes(root)), default=-1) + 1
    archives = _started_archives(info)
    linked = bool(archives) and seed.links_reach(root)
    try:
        store = _seed(archives) if linked else None
        node = kubelet.start_kubelet_node(plane, root / f"n{index}", timeout, index, labels,
                                          images=store, record=False)
        if archives and not linked:
            _import_all(node, archives)
    except (kubelet.KubeletNodeError, seed.SeedError) as err:
        raise ControlPlaneError(str(err)) from err
    return node.name


def _started_archives(info: dict[str, Any]) -> dict[str, Path]:
    """The image archives the cluster started with (not a build of the source as it is now:
    every node runs the same images)."""
    if "imageArchives" not in info:  # a cluster started before they were recorded
        return _image_archives(tuple(info.get("images") or ()))
    archives = {t: Path(a) for t, a in info["imageArchives"].items()}
    if gone := [str(a) for a in archives.values() if not a.exists()]:
        raise ControlPlaneError(f"the images this cluster started with are gone from the cache "
                                f"({gone[0]}): restart it (`gemini local down`, then `up`)")
    return archives


def seed_images(targets: list[str]) -> Path:
    """The images `targets`, built if their source changed, in the kubelet nodes' image seed
    (`./dev test` prepares it before the tests); the seed's containerd root."""
    return _seed(_image_archives(tuple(targets)))


def _seed(archives: dict[str, Path]) -> Path:
    from gemini_local.kubelet import seed

    try:
        return seed.prepare({images_mod.image_name(t): (a, images_mod.full_name(t))
                             for t, a in archives.items()})
    except seed.SeedError as err:
        raise ControlPlaneError(str(err)) from err


def _import_all(node: Any, archives: dict[str, Path]) -> None:
    for target, archive in archives.items():
        node.import_image(archive, images_mod.image_name(target), images_mod.full_name(target))


def _stop_kubelet_nodes(state_dir: Path) -> list[str]:
    from gemini_local import faults, kubelet

    root = state_dir / KUBELET_NODES
    plane = ControlPlane.load(state_dir)
    if plane is None or not root.exists():
        return []
    running = [f"kubelet node {n.name}" for n in kubelet.kubelet_nodes(root)
               if any(n.running_pids().values())]
    faults.clear_kubelet_tables()
    problems = kubelet.stop_kubelet_nodes(plane, root)
    if problems:
        print("kubelet nodes left behind: " + "; ".join(problems), file=sys.stderr)
    shutil.rmtree(root, ignore_errors=True)
    return running


def _host_from_pods(state_dir: Path, kubelet: bool) -> str:
    """The host's address as pods reach it (a service on the host bound to every address, the
    operator's hint server or S3): node agents' pods share the host's loopback; a kubelet
    node's pod has its own and reaches the host at its bridge's address, the first node's
    here (a lost node keeps its bridge)."""
    from gemini_local.kubelet import KubeletNode

    return KubeletNode.at(0, state_dir / KUBELET_NODES / "n0").gateway if kubelet \
        else "127.0.0.1"


def _start_s3(state_dir: Path, pods_reach_host_at: str) -> dict[str, Any]:
    """The S3 endpoint; also `podURL`, where pods reach it (the same as `url` on node agents)."""
    from gemini_local import s3

    pod_address = [] if pods_reach_host_at == "127.0.0.1" else [pods_reach_host_at]
    endpoint = s3.start_s3(state_dir / "s3", also_on=pod_address)
    info = endpoint.to_dict()
    info["podURL"] = endpoint.url.replace("127.0.0.1", pods_reach_host_at)
    return info


def _start_kueue(plane: ControlPlane, state_dir: Path) -> dict[str, Any]:
    """Kueue, and a queue `local` (LocalQueue in `default`) whose quota is every node's CPU
    and memory: label a job `kueue.x-k8s.io/queue-name: local` to have it queued."""
    from gemini_local import kueue
    from gemini_local.nodeagent.podspec import parse_quantity

    kueue.start_kueue(plane, state_dir / "kueue")
    nodes = _core_api(plane).list_node().items
    quota = {resource: str(int(sum(parse_quantity(n.status.allocatable[resource])
                                   for n in nodes)))
             for resource in ("cpu", "memory")}
    kueue.queue_setup(plane, "default", LOCAL_QUEUE, quota)
    return {"localQueue": f"default/{LOCAL_QUEUE}", "quota": quota}


def _start_monitoring(plane: ControlPlane, state_dir: Path) -> dict[str, Any]:
    from gemini_local import monitoring

    try:
        return monitoring.start_monitoring(plane, state_dir / "monitoring")
    except monitoring.MonitoringError as err:
        raise ControlPlaneError(str(err)) from err


def attach(state_dir: Path, name: str, pid: int, executable: str) -> None:
    """Have `down` stop a process that uses the cluster (e.g. a demo's operator left running
    by `gemini demo --keep`) before the cluster itself. It must lead its own session."""
    processes.record(ATTACHED_PREFIX + name, pid, executable, state_dir / "pids")


def _stop_attached(state_dir: Path) -> list[str]:
    pid_dir = state_dir / "pids"
    names = sorted(p.stem for p in pid_dir.glob(f"{ATTACHED_PREFIX}*.pid"))
    return [name.removeprefix(ATTACHED_PREFIX) for name in names
            if processes.stop(name, pid_dir)]


def down(state_dir: Path) -> list[str]:
    """Stop everything started in `state_dir` (and the processes attached to it); return what
    was running (empty: nothing was)."""
    from gemini_local import kueue, monitoring, nodes, s3

    stopped = _stop_attached(state_dir)
    if kueue.stop_kueue(state_dir / "kueue"):
        stopped.append("kueue")
    if monitoring.stop_monitoring(state_dir / "monitoring"):
        stopped.append("monitoring")
    stopped += [f"node-agent {n}" for n in nodes.stop_all_node_agents(state_dir) or []]
    stopped += _stop_kubelet_nodes(state_dir)
    if (state_dir / "s3").exists() and s3.stop_s3(state_dir / "s3"):
        stopped.append("s3")
    stopped += controlplane.stop_control_plane(state_dir)
    return stopped


def status(state_dir: Path) -> dict[str, Any]:
    """Components with their pids, and nodes with their Ready condition as the API reports it."""
    components = controlplane.running_components(state_dir)
    plane = ControlPlane.load(state_dir)
    result: dict[str, Any] = {
        "stateDir": str(state_dir),
        "running": all(pid is not None for pid in components.values()),
        "components": {name: {"pid": pid, "running": pid is not None}
                       for name, pid in components.items()},
        "nodes": [],
    }
    if plane is not None and components["kube-apiserver"] is not None:
        result["kubeconfig"] = str(plane.kubeconfig)
        result["apiServer"] = plane.api_url
        result["nodes"] = _node_health(plane)
    meta = state_dir / "cluster.json"
    if meta.exists():
        recorded = json.loads(meta.read_text())
        result.update({k: recorded.get(k) for k in ("s3", "kueue", "hostFromPods")})
        result["monitoring"] = _monitoring_status(state_dir, recorded.get("monitoring"))
    return result


def _monitoring_status(state_dir: Path, recorded: dict[str, Any] | None) -> dict[str, Any] | None:
    """What `up` recorded of monitoring, with which of its processes still run."""
    from gemini_local import monitoring

    if recorded is None:
        return None
    pids = monitoring.running(state_dir / "monitoring")
    return {**recorded, "pids": pids, "running": all(p is not None for p in pids.values())}


def _core_api(plane: ControlPlane) -> Any:
    from kubernetes import client, config

    return client.CoreV1Api(config.new_client_from_config(str(plane.kubeconfig)))


def _node_health(plane: ControlPlane) -> list[dict[str, str]]:
    rows = []
    for node in _core_api(plane).list_node(_request_timeout=5).items:
        ready = next((c for c in node.status.conditions or [] if c.type == "Ready"), None)
        labels = node.metadata.labels or {}
        rows.append({
            "name": node.metadata.name,
            "ready": ready.status if ready else "Unknown",
            "reason": ready.reason if ready else "",
            "zone": labels.get(ZONE_LABEL, ""),
            "rack": labels.get(RACK_LABEL, ""),
        })
    return rows


def _wait_nodes_ready(plane: ControlPlane, count: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    ready: list[str] = []
    while time.monotonic() < deadline:
        ready = [n["name"] for n in _node_health(plane) if n["ready"] == "True"]
        if len(ready) >= count:
            return
        time.sleep(0.2)
    raise ControlPlaneError(
        f"only {len(ready)} of {count} nodes became Ready within {timeout:.0f}s; "
        f"see the node agents' logs under {plane.state_dir / 'nodes'}"
    )
