# Over 500 lines: one kubelet node from the host check to its stop (bridge, CNI, containerd,
# kubelet flags): each step uses the paths and names the one before chose.
"""One real kubelet node (kubelet, containerd, runc, bridge CNI) on the local control plane.

Everything the node owns lives under its state folder: containerd's config, root, state and
socket, runc's state, the kubelet's root dir, config, certificates and pod logs, the CNI config
and IPAM state, logs and pid files. What cannot live there, and what the teardown puts back:

- sysctls the kubelet and the bridge plugin change (`vm.overcommit_memory`, `kernel.panic`,
  `kernel.panic_on_oops`, `net.ipv4.ip_forward`): recorded in `host.json` before the start;
- the cgroup root (`/gemini-kubelet` in every cgroup hierarchy, one `n<index>` below it per
  node), made before the start;
- the bridge `gmkubelet<index>` of each node and its veths, the pods' network namespaces under
  `/run/netns`;
- the kubelet's iptables chains (KUBE-IPTABLES-HINT, KUBE-KUBELET-CANARY, KUBE-FIREWALL with
  its jumps from INPUT and OUTPUT) and the nftables tables iptables-nft made to hold them;
- fixed paths that containerd 1.6 and the kubelet create (`/run/containerd`, `/var/lib/cni`,
  `/var/lib/kubelet/device-plugins`, `/var/log/containers`): removed when the start made them.

One set of kubelet nodes per machine at a time (the bridges, the cgroup root and the sysctls
are machine-wide; `CLAIM` names the set while it exists): one node alone (`start_kubelet_node`)
or several (`start_kubelet_nodes`, the host recorded once for all of them). Node `i` is named
by its IP, 127.0.50.<i+1>: the kubelet refuses a loopback `--node-ip`, but an IP given as
`--hostname-override` becomes the node's InternalIP, on which the API server reaches the
kubelet (logs, exec). Its pods get addresses from 10.250.<50+i>.0/24 on its bridge, whose
address (.1) is their gateway: pods of different nodes reach each other through the host's
routes between the bridges, as through a network.

A run killed before its teardown (SIGKILL, a lost session) leaves its nodes' host changes
behind with none of their daemons running; the next start finds them by the claim and undoes
them first (`reclaim_stale_nodes`). A claim whose daemons still run is refused.

Every node has its own containerd (root, state, socket) and its own cgroup root, so that one
node is lost (`lose_kubelet_node`: kubelet, containerd and every container killed at once)
without touching the others.

Credentials: the kubelet gets its own client certificate (user `system:node:<name>`, group
`system:nodes`) with the `system:node` ClusterRole bound to it (the API server runs RBAC without
the Node authorizer), and a serving certificate from the cluster CA. It authenticates the API
server by the cluster CA and authorizes everything that authenticates (AlwaysAllow).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gemini_local import processes
from gemini_local.controlplane import REPO_ROOT, ControlPlane, binaries_dir
from gemini_local.kubelet import host, seed
from gemini_local.kubelet.host import CGROUP_ROOT
from gemini_local.kubelet.oci import write_image

PAUSE_IMAGE = "gemini.local/pause:1"
PAUSE_BUILD_SCRIPT = REPO_ROOT / "hack" / "build-pause.sh"
BRIDGE_PREFIX = "gmkubelet"
# Spares added as nodes are lost take new indices: a long test run uses dozens. The group
# ids stay below the node agents' of cluster 51 (gemini_local.nodeagent.addressing).
MAX_NODES = 64
POD_NETWORK = "10.250.0.0/16"  # node i's pods: 10.250.<50+i>.0/24
CNI_BIN_DIR = Path("/usr/lib/cni")
CLAIM = Path("/run/gemini-kubelet-nodes")  # the record folder of this machine's kubelet nodes
NODE_FILE = "node.json"  # in each node's state folder: its name, index and labels
POD_LOGS = Path("kubelet", "pod-logs")  # under each node's state folder: the podLogsDir
_CONTAINERD, _KUBELET = "containerd", "kubelet"


class KubeletNodeError(RuntimeError):
    """A kubelet node cannot be started or did not come up; the message says why."""


@dataclass(frozen=True)
class KubeletNode:
    name: str
    state_dir: Path
    index: int = 0
    labels: tuple[tuple[str, str], ...] = ()

    @classmethod
    def at(cls, index: int, state_dir: Path, labels: dict[str, str] | None = None) -> KubeletNode:
        if not 0 <= index < MAX_NODES:
            raise KubeletNodeError(f"a kubelet node index must be 0..{MAX_NODES - 1}, not {index}")
        return cls(f"127.0.50.{index + 1}", state_dir, index, tuple(sorted((labels or {}).items())))

    @classmethod
    def load(cls, state_dir: Path) -> KubeletNode:
        saved = json.loads((state_dir / NODE_FILE).read_text())
        return cls.at(int(saved["index"]), state_dir, saved.get("labels"))

    def save(self) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        (self.state_dir / NODE_FILE).write_text(json.dumps(
            {"name": self.name, "index": self.index, "labels": dict(self.labels)}))

    @property
    def bridge(self) -> str:
        return f"{BRIDGE_PREFIX}{self.index}"

    @property
    def pod_subnet(self) -> str:
        return f"10.250.{50 + self.index}.0/24"

    @property
    def gateway(self) -> str:
        """The bridge's address: the pods' gateway, and the host as its pods reach it."""
        return f"10.250.{50 + self.index}.1"

    @property
    def gid(self) -> int:
        """The kubelet's group id, by which nftables tells its packets apart (a partition);
        above the node agents' (gemini_local.nodeagent.addressing), below their first."""
        return 200_000 + 50 * 256 + self.index + 1

    @property
    def cgroup_sub(self) -> str:
        """The node's cgroup root below the machine-wide one."""
        return f"n{self.index}"

    @property
    def pid_dir(self) -> Path:
        return self.state_dir / "pids"

    @property
    def log_dir(self) -> Path:
        return self.state_dir / "logs"

    @property
    def containerd_root(self) -> Path:
        return self.state_dir / "containerd" / "root"

    @property
    def containerd_socket(self) -> Path:
        return self.state_dir / "containerd" / "containerd.sock"

    def ctr(self, *args: str, timeout: float = 60) -> str:
        """Run `ctr -n k8s.io ARGS` against this node's containerd; its stdout."""
        result = subprocess.run(
            ["ctr", f"--address={self.containerd_socket}", "--namespace=k8s.io", *args],
            capture_output=True, text=True, timeout=timeout, check=False)
        if result.returncode != 0:
            raise KubeletNodeError(f"ctr {' '.join(args)} failed: {result.stderr.strip()}")
        return result.stdout

    def import_image(self, archive: Path, name: str, full_name: str) -> None:
        """Import an OCI archive whose image is `name` and name it `full_name` too (what the
        kubelet asks for: a short name means Docker Hub's library)."""
        self.ctr("images", "import", str(archive), timeout=600)
        self.ctr("images", "tag", "--force", name, full_name)

    def _running_task(self, namespace: str, pod: str, container: str) -> tuple[str, int] | None:
        labels = {"io.kubernetes.pod.namespace": namespace, "io.kubernetes.pod.name": pod,
                  "io.kubernetes.container.name": container}
        wanted = ",".join(f'labels."{k}"=={v}' for k, v in labels.items())
        ids = set(self.ctr("containers", "ls", "-q", wanted).split())
        for line in self.ctr("tasks", "ls").splitlines()[1:]:
            task, pid, status = [*line.split(), "", "", ""][:3]
            if task in ids and status == "RUNNING":
                return task, int(pid)
        return None

    def task_pid(self, namespace: str, pod: str, container: str) -> int | None:
        """The host pid of the running container `container` of pod `namespace/pod` (its first
        process), or None when no such container runs here."""
        task = self._running_task(namespace, pod, container)
        return task[1] if task else None

    def kill_container(self, namespace: str, pod: str, container: str, sig: str) -> int | None:
        """Send `sig` (e.g. SIGKILL) to every process of the running container `container` of
        pod `namespace/pod`; its pid, or None when no such container runs here."""
        task = self._running_task(namespace, pod, container)
        if task is not None:
            self.ctr("tasks", "kill", "--all", f"--signal={sig}", task[0])
        return task[1] if task else None

    def running_pids(self) -> dict[str, int | None]:
        return {d: processes.running_pid(d, self.pid_dir) for d in (_CONTAINERD, _KUBELET)}


def pause_binary() -> Path:
    """The pause binary (hack/pause), built first when missing (seconds, with Go)."""
    result = subprocess.run(["bash", str(PAUSE_BUILD_SCRIPT)], stdout=subprocess.PIPE,
                            text=True, check=False)
    if result.returncode != 0:
        raise KubeletNodeError(f"building the pause binary failed (exit {result.returncode}); "
                               f"run {PAUSE_BUILD_SCRIPT} to see why")
    return Path(result.stdout.strip().splitlines()[-1])


def start_kubelet_node(plane: ControlPlane, state_dir: Path, timeout: float = 120.0,
                       index: int = 0, labels: dict[str, str] | None = None,
                       images: Path | None = None, record: bool = True) -> KubeletNode:
    """Start containerd (from the image seed `images`, if given) and a kubelet joined to
    `plane`, import the pause image, and wait until the Node is Ready. `record`: note the
    host's settings in `state_dir` first (not for a node added to a recorded cluster). On
    failure everything started is torn down again."""
    node = KubeletNode.at(index, state_dir, labels)
    _check_host([node], joining=None if record else state_dir.parent)
    state_dir.mkdir(parents=True, exist_ok=True)
    if record:
        host.record(state_dir)
        _claim(state_dir)
    try:
        _launch(plane, node, timeout, images)
        _wait_for(lambda: _node_ready(plane, node.name), timeout, f"node {node.name} Ready",
                  node, _KUBELET)
    except BaseException:
        if record:
            stop_kubelet_node(plane, node)
        else:  # the machine-wide changes belong to the running set: leave them
            _remove_added_node(plane, node)
        raise
    return node


def start_kubelet_nodes(plane: ControlPlane, root: Path, labels: list[dict[str, str]],
                        timeout: float = 120.0, images: Path | None = None
                        ) -> list[KubeletNode]:
    """Start one kubelet node per entry of `labels` (node i under `root/n<i>`, with those
    labels) and wait until every Node is Ready; the host is recorded once, in `root`. Each
    node's containerd starts with the images of the seed store `images` (`seed.prepare`). On
    failure everything started is torn down again (`stop_kubelet_nodes`)."""
    nodes = [KubeletNode.at(i, root / f"n{i}", node_labels) for i, node_labels in
             enumerate(labels)]
    _check_host(nodes)
    root.mkdir(parents=True, exist_ok=True)
    host.record(root)
    _claim(root)
    try:
        for node in nodes:
            _launch(plane, node, timeout, images)
        for node in nodes:
            _wait_for(lambda n=node: _node_ready(plane, n.name), timeout,  # type: ignore[misc]
                      f"node {node.name} Ready", node, _KUBELET)
    except BaseException:
        stop_kubelet_nodes(plane, root)
        raise
    return nodes


def kubelet_nodes(root: Path) -> list[KubeletNode]:
    """The nodes `start_kubelet_nodes` started under `root` (running or not)."""
    found = [KubeletNode.load(d) for d in root.glob("n*") if (d / NODE_FILE).exists()]
    return sorted(found, key=lambda n: n.index)


def reclaim_stale_nodes() -> list[str]:
    """Undo the host changes of kubelet nodes whose run was killed before its teardown (the
    claim names them and none of their daemons runs); nodes still running are left alone.
    Returns what was undone and what could not be, for a message (empty: nothing stale)."""
    root = _claimed_root()
    if root is None:
        return []
    nodes = _recorded_nodes(root)
    if any(pid is not None for n in nodes for pid in n.running_pids().values()):
        return []
    problems: list[str] = []
    for node in nodes:
        _kill_shims(node)
    stale_bridges = sorted(p.name for p in Path("/sys/class/net").glob(f"{BRIDGE_PREFIX}*"))
    for bridge in stale_bridges:  # named by the prefix: the record folder may be gone
        _delete_bridge(bridge, problems)
    _undo_host(None, root, nodes, problems)  # drops the claim
    return [f"kubelet nodes left under {root} by a run that died ({len(nodes)} nodes, bridges "
            f"{', '.join(stale_bridges) or 'none'})", *problems]


def _claim(record_dir: Path) -> None:
    CLAIM.write_text(f"{record_dir.resolve()}\n")


def _claimed_root() -> Path | None:
    try:
        return Path(CLAIM.read_text().strip())
    except OSError:
        return None


def _recorded_nodes(record_dir: Path) -> list[KubeletNode]:
    """The nodes recorded under `record_dir`: a set (`n<i>` folders) or one node alone."""
    if (record_dir / NODE_FILE).exists():
        return [KubeletNode.load(record_dir)]
    return kubelet_nodes(record_dir) if record_dir.exists() else []


def _check_host(nodes: list[KubeletNode], joining: Path | None = None) -> None:
    """Refuse a start that would collide with kubelet nodes on this machine (a node `joining`
    the running set recorded there is no collision) or that lacks a tool."""
    if cleaned := reclaim_stale_nodes():
        print("note: cleaned up " + "; ".join(cleaned), file=sys.stderr)
    missing = [t for t in ("containerd", "runc", "ctr") if shutil.which(t) is None]
    if missing or not (CNI_BIN_DIR / "bridge").exists():
        raise KubeletNodeError(
            f"missing {', '.join(missing) or CNI_BIN_DIR / 'bridge'}: run ./dev setup (it installs "
            "containerd runc containernetworking-plugins iptables)")
    running = _kubelet_names()
    if taken := [n.name for n in nodes if n.name in running]:
        raise KubeletNodeError(f"a kubelet for node {taken[0]} already runs on this machine "
                               "(`gemini local down` stops a local cluster's)")
    root = _claimed_root()
    if root is not None and (joining is None or root != joining.resolve()):
        raise KubeletNodeError(f"kubelet nodes under {root} run on this machine (one set at a "
                               "time; `gemini local down` stops a local cluster's)")
    if taken := [n.bridge for n in nodes if Path(f"/sys/class/net/{n.bridge}").exists()]:
        raise KubeletNodeError(f"bridge {taken[0]} exists: are other kubelet nodes running on "
                               "this machine? (`gemini local down` stops a local cluster's)")
    if not (binaries_dir() / "kubelet").exists():
        raise KubeletNodeError(f"{binaries_dir() / 'kubelet'} is missing: run "
                               "hack/build-binaries.sh")


def _kubelet_names() -> set[str]:
    """The node names (`--hostname-override`) of the kubelets running on this machine."""
    names = set()
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if argv and Path(argv[0]).name == _KUBELET:
            names |= {a.split("=", 1)[1] for a in argv if a.startswith("--hostname-override=")}
    return names


def _launch(plane: ControlPlane, node: KubeletNode, timeout: float,
            images: Path | None = None) -> None:
    """Start the node's containerd (its root a copy of the image seed `images`, if given),
    import the pause image, start its kubelet (not waiting for the Node to be Ready)."""
    pause = pause_binary()
    node.save()
    host.make_cgroup_root(node.cgroup_sub)
    _write_cni_config(node)
    _make_bridge(node)
    config = _write_containerd_config(node)
    if images is not None:
        seed.clone(images, node.containerd_root)
    processes.spawn(_CONTAINERD, ["containerd", f"--config={config}"],
                    node.pid_dir, node.log_dir)
    _wait_for(lambda: node.containerd_socket.exists() and _ctr_ok(node), timeout,
              "containerd's socket", node, _CONTAINERD)
    image = write_image(pause, PAUSE_IMAGE, node.state_dir / "images" / "pause.tar")
    node.ctr("images", "import", "--no-unpack=false", str(image))
    processes.spawn(_KUBELET, _kubelet_args(binaries_dir() / "kubelet", node, plane),
                    node.pid_dir, node.log_dir, group=node.gid)


def _ctr_ok(node: KubeletNode) -> bool:
    try:
        node.ctr("version", timeout=5)
    except (KubeletNodeError, subprocess.TimeoutExpired):
        return False
    return True


def _wait_for(predicate: Any, timeout: float, what: str, node: KubeletNode, daemon: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if processes.running_pid(daemon, node.pid_dir) is None:
            raise KubeletNodeError(f"{daemon} exited while waiting for {what}; end of its log:\n"
                                   + _log_tail(node, daemon))
        if predicate():
            return
        time.sleep(0.2)
    raise KubeletNodeError(f"no {what} after {timeout:.0f}s; end of the {daemon} log:\n"
                           + _log_tail(node, daemon))


def _log_tail(node: KubeletNode, daemon: str, lines: int = 15) -> str:
    log = node.log_dir / f"{daemon}.log"
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return f"(no {log})"


def _core(plane: ControlPlane) -> Any:
    from kubernetes import client, config

    return client.CoreV1Api(config.new_client_from_config(str(plane.kubeconfig)))


def _node_ready(plane: ControlPlane, name: str) -> bool:
    from kubernetes import client

    try:
        node = _core(plane).read_node(name)
    except client.ApiException:
        return False
    return any(c.type == "Ready" and c.status == "True" for c in node.status.conditions or [])


def _make_bridge(node: KubeletNode) -> None:
    """The node's bridge with its gateway address, before any pod: host services (the local
    S3) can listen there from the start. The bridge CNI plugin takes it as it finds it."""
    problems: list[str] = []
    ok = (host.run(["ip", "link", "add", node.bridge, "type", "bridge"], problems)
          and host.run(["ip", "addr", "add", f"{node.gateway}/24", "dev", node.bridge], problems)
          and host.run(["ip", "link", "set", node.bridge, "up"], problems))
    if not ok:
        raise KubeletNodeError(f"the bridge of node {node.name}: {'; '.join(problems)}")


def _write_cni_config(node: KubeletNode) -> None:
    conf_dir = node.state_dir / "cni" / "net.d"
    conf_dir.mkdir(parents=True, exist_ok=True)
    (conf_dir / "10-gemini.conflist").write_text(json.dumps({
        "cniVersion": "1.0.0", "name": "gemini-kubelet",
        "plugins": [{
            # The bridge is the pods' gateway (routes between the nodes' bridges); no
            # masquerading: pod addresses are seen as they are, as in a flat pod network.
            "type": "bridge", "bridge": node.bridge, "isGateway": True, "ipMasq": False,
            "ipam": {"type": "host-local", "ranges": [[{"subnet": node.pod_subnet}]],
                     "routes": [{"dst": POD_NETWORK}],
                     "dataDir": str(node.state_dir / "cni" / "ipam")},
        }],
    }, indent=2))


def _write_containerd_config(node: KubeletNode) -> Path:
    d = node.state_dir / "containerd"
    d.mkdir(parents=True, exist_ok=True)
    cri = 'plugins."io.containerd.grpc.v1.cri"'
    config = f"""\
version = 2
root = "{node.containerd_root}"
state = "{d / 'state'}"

[grpc]
  address = "{node.containerd_socket}"
[ttrpc]
  address = "{node.containerd_socket}.ttrpc"
[debug]
  address = ""
[metrics]
  address = ""

[plugins."io.containerd.internal.v1.opt"]
  path = "{d / 'opt'}"

[{cri}]
  sandbox_image = "{PAUSE_IMAGE}"
  # These machines withhold CAP_SYS_RESOURCE: runc cannot set a negative oom_score_adj, and
  # without this every sandbox fails with "can't get final child's PID from pipe: EOF".
  restrict_oom_score_adj = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
[{cri}.containerd]
  snapshotter = "overlayfs"
  default_runtime_name = "runc"
[{cri}.containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"
[{cri}.containerd.runtimes.runc.options]
  SystemdCgroup = false
  Root = "{d / 'runc'}"
[{cri}.cni]
  bin_dir = "{CNI_BIN_DIR}"
  conf_dir = "{node.state_dir / 'cni' / 'net.d'}"
  max_conf_num = 1
"""
    path = d / "config.toml"
    path.write_text(config)
    return path


def _kubelet_args(kubelet: Path, node: KubeletNode, plane: ControlPlane) -> list[str]:
    from kubernetes import client

    d = node.state_dir / "kubelet"
    d.mkdir(parents=True, exist_ok=True)
    user = f"system:node:{node.name}"
    cert, key = plane.pki.issue(f"kubelet-{node.name}-client", user, ("system:nodes",),
                                client=True)
    serving_cert, serving_key = plane.pki.issue(f"kubelet-{node.name}-serving", node.name,
                                                ips=(node.name,), server=True)
    kubeconfig = d / "kubeconfig"
    kubeconfig.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "node",
        "clusters": [{"name": "local", "cluster": {
            "server": plane.api_url, "certificate-authority": str(plane.pki.ca_cert)}}],
        "users": [{"name": user, "user": {"client-certificate": str(cert),
                                          "client-key": str(key)}}],
        "contexts": [{"name": "node", "context": {"cluster": "local", "user": user}}],
    }))
    rbac = client.RbacAuthorizationV1Api(_core(plane).api_client)
    binding: Any = {
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
        "metadata": {"name": f"gemini-kubelet-{node.name}"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                    "name": "system:node"},
        "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": user}]}
    try:
        rbac.create_cluster_role_binding(binding)
    except client.ApiException as err:
        if err.status != 409:
            raise
    port, healthz_port = processes.free_port(node.name), processes.free_port(node.name)
    config = {
        "apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
        "address": node.name, "port": port, "readOnlyPort": 0,
        "healthzBindAddress": node.name, "healthzPort": healthz_port,
        "tlsCertFile": str(serving_cert), "tlsPrivateKeyFile": str(serving_key),
        "authentication": {"anonymous": {"enabled": False}, "webhook": {"enabled": False},
                           "x509": {"clientCAFile": str(plane.pki.ca_cert)}},
        "authorization": {"mode": "AlwaysAllow"},
        "containerRuntimeEndpoint": f"unix://{node.containerd_socket}",
        # Kubernetes 1.35 refuses these machines' v1/v2 hybrid cgroups unless told otherwise.
        "failCgroupV1": False, "cgroupDriver": "cgroupfs",
        "cgroupRoot": f"{CGROUP_ROOT}/{node.cgroup_sub}",
        "failSwapOn": False, "oomScoreAdj": 0,
        "podLogsDir": str(node.state_dir / POD_LOGS), "volumePluginDir": str(d / "volume-plugins"),
        # A small shared disk and memory: evict only at the very end, collect no images.
        "evictionHard": {"memory.available": "1Mi", "nodefs.available": "1%",
                         "nodefs.inodesFree": "1%", "imagefs.available": "1%"},
        "imageGCHighThresholdPercent": 100, "imageGCLowThresholdPercent": 99,
        # The control plane marks a node silent for 8 s NotReady: renew the lease every second.
        "nodeLeaseDurationSeconds": 4, "nodeStatusUpdateFrequency": "2s",
        "syncFrequency": "10s", "fileCheckFrequency": "10s",
        "maxPods": 16, "serializeImagePulls": False,
    }
    config_path = d / "config.json"
    config_path.write_text(json.dumps(config, indent=2))
    return [str(kubelet), f"--config={config_path}", f"--kubeconfig={kubeconfig}",
            f"--root-dir={d / 'root'}", f"--cert-dir={d / 'pki'}",
            f"--hostname-override={node.name}", "--v=1",
            *([f"--node-labels={','.join(f'{k}={v}' for k, v in node.labels)}"]
              if node.labels else [])]


# --- teardown ---------------------------------------------------------------------------------

def stop_kubelet_node(plane: ControlPlane, node: KubeletNode) -> list[str]:
    """Delete the node's pods, stop the kubelet and containerd, and undo every host change.

    Returns what could not be undone (empty when the host is as before the start)."""
    problems = _stop_daemons(plane, node)
    _undo_host(plane, node.state_dir, [node], problems)
    return problems


def stop_kubelet_nodes(plane: ControlPlane, root: Path) -> list[str]:
    """`stop_kubelet_node` for every node started under `root`, the host put back once."""
    nodes = kubelet_nodes(root)
    problems = [p for node in nodes for p in _stop_daemons(plane, node)]
    _undo_host(plane, root, nodes, problems)
    return problems


def lose_kubelet_node(node: KubeletNode) -> int:
    """A power loss: SIGKILL the node's kubelet, containerd, shims and every container at once,
    cleaning nothing up; return how many daemons were running. The Node stops renewing its
    lease and the control plane finds out on its own."""
    running = [pid for pid in node.running_pids().values() if pid is not None]
    for pid in running:
        with contextlib.suppress(OSError):
            os.killpg(pid, 9)
    _kill_shims(node)
    host.kill_cgroup_processes(node.cgroup_sub)
    return len(running)


def _remove_added_node(plane: ControlPlane, node: KubeletNode) -> list[str]:
    """Undo what a node added to a running set owns alone: its daemons, containers, mounts
    and bridge (the set's cgroup root, sysctls and iptables stay)."""
    problems = _stop_daemons(plane, node)
    host.kill_cgroup_processes(node.cgroup_sub)
    host.unmount_under(node.state_dir, problems)
    _delete_bridge(node.bridge, problems)
    return problems


def _delete_bridge(name: str, problems: list[str]) -> None:
    if Path(f"/sys/class/net/{name}").exists():
        host.run(["ip", "link", "delete", name], problems)


def _stop_daemons(plane: ControlPlane, node: KubeletNode) -> list[str]:
    problems: list[str] = []
    if processes.running_pid(_KUBELET, node.pid_dir) is not None:
        _delete_pods(plane, node, problems)
    processes.stop(_KUBELET, node.pid_dir, grace_seconds=10)
    if processes.running_pid(_CONTAINERD, node.pid_dir) is not None:
        _kill_tasks(node, problems)
    processes.stop(_CONTAINERD, node.pid_dir, grace_seconds=10)
    _kill_shims(node)
    return problems


def _undo_host(plane: ControlPlane | None, record_dir: Path, nodes: list[KubeletNode],
               problems: list[str]) -> None:
    """Put the host back as `record_dir/host.json` recorded it, delete the nodes' bridges,
    and their Node objects and bindings when `plane` is given; drop the claim."""
    host.unmount_under(record_dir, problems)
    state = host.load(record_dir)
    host.remove_netns(set(state.get("netns", [])), problems)
    for node in nodes:
        _delete_bridge(node.bridge, problems)
    host.remove_cgroups(problems)
    if state:
        host.remove_iptables(state, problems)
    host.restore(state, problems)
    if _claimed_root() == record_dir.resolve():
        CLAIM.unlink(missing_ok=True)
    if plane is None:
        return
    with contextlib.suppress(Exception):
        from kubernetes import client

        core = _core(plane)
        rbac = client.RbacAuthorizationV1Api(core.api_client)
        for node in nodes:
            with contextlib.suppress(Exception):
                core.delete_node(node.name)
            with contextlib.suppress(Exception):
                rbac.delete_cluster_role_binding(f"gemini-kubelet-{node.name}")


def _delete_pods(plane: ControlPlane, node: KubeletNode, problems: list[str]) -> None:
    """Delete the node's pods through the API and let the kubelet tear them down properly
    (CNI DEL, sandbox stop), so that no task is left to kill by force."""
    try:
        core = _core(plane)
        pods = core.list_pod_for_all_namespaces(field_selector=f"spec.nodeName={node.name}").items
        for p in pods:
            with contextlib.suppress(Exception):
                core.delete_namespaced_pod(p.metadata.name, p.metadata.namespace,
                                           grace_period_seconds=1)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            left = core.list_pod_for_all_namespaces(
                field_selector=f"spec.nodeName={node.name}").items
            if not left and not _tasks(node):
                return
            time.sleep(0.5)
        problems.append("the kubelet did not remove its pods within 60 s (killed by force)")
    except Exception as err:  # the API may be gone already: fall back to killing tasks
        problems.append(f"deleting the node's pods: {err}")


def _tasks(node: KubeletNode) -> list[str]:
    try:
        return node.ctr("tasks", "ls", "-q", timeout=10).split()
    except (KubeletNodeError, subprocess.TimeoutExpired):
        return []


def _kill_tasks(node: KubeletNode, problems: list[str]) -> None:
    tasks = _tasks(node)
    for task in tasks:
        with contextlib.suppress(KubeletNodeError, subprocess.TimeoutExpired):
            node.ctr("tasks", "kill", "--all", "--signal=SIGKILL", task, timeout=10)
    for task in tasks:
        try:
            node.ctr("tasks", "delete", "--force", task, timeout=20)
        except (KubeletNodeError, subprocess.TimeoutExpired) as err:
            problems.append(f"task {task}: {err}")


def _kill_shims(node: KubeletNode) -> None:
    """Shims run in their own process groups and outlive containerd: kill ours (those that
    name our socket) by pid."""
    marker = str(node.containerd_socket).encode()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if cmdline and cmdline[0].endswith(b"containerd-shim-runc-v2") and marker in cmdline:
            with contextlib.suppress(OSError):
                os.kill(int(proc.name), 9)


