"""One real kubelet node (kubelet, containerd, runc, bridge CNI) on the local control plane.

Everything the node owns lives under its state folder: containerd's config, root, state and
socket, runc's state, the kubelet's root dir, config, certificates and pod logs, the CNI config
and IPAM state, logs and pid files. What cannot live there, and what the teardown puts back:

- sysctls the kubelet and the bridge plugin change (`vm.overcommit_memory`, `kernel.panic`,
  `kernel.panic_on_oops`, `net.ipv4.ip_forward`): recorded in `host.json` before the start;
- the cgroup root (`/gemini-kubelet` in every cgroup hierarchy), made before the start;
- the bridge `gmkubelet0` and its veths, the pods' network namespaces under `/run/netns`;
- the kubelet's iptables chains (KUBE-IPTABLES-HINT, KUBE-KUBELET-CANARY, KUBE-FIREWALL with
  its jumps from INPUT and OUTPUT) and the nftables tables iptables-nft made to hold them;
- fixed paths that containerd 1.6 and the kubelet create (`/run/containerd`, `/var/lib/cni`,
  `/var/lib/kubelet/device-plugins`, `/var/log/containers`): removed when the start made them.

One kubelet node per machine at a time (the bridge, the cgroup root and the sysctls are
machine-wide). Its node name is its IP, 127.0.50.1: the kubelet refuses a loopback `--node-ip`,
but an IP given as `--hostname-override` becomes the node's InternalIP, on which the API server
reaches the kubelet (logs, exec).

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
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gemini_local import processes
from gemini_local.controlplane import REPO_ROOT, ControlPlane, binaries_dir
from gemini_local.kubelet import host
from gemini_local.kubelet.host import CGROUP_ROOT
from gemini_local.kubelet.oci import write_image

PAUSE_IMAGE = "gemini.local/pause:1"
PAUSE_BUILD_SCRIPT = REPO_ROOT / "hack" / "build-pause.sh"
NODE_ADDRESS = "127.0.50.1"
BRIDGE = "gmkubelet0"
POD_SUBNET = "10.250.50.0/24"
CNI_BIN_DIR = Path("/usr/lib/cni")
_CONTAINERD, _KUBELET = "containerd", "kubelet"


class KubeletNodeError(RuntimeError):
    """A kubelet node cannot be started or did not come up; the message says why."""


@dataclass(frozen=True)
class KubeletNode:
    name: str
    state_dir: Path

    @property
    def pid_dir(self) -> Path:
        return self.state_dir / "pids"

    @property
    def log_dir(self) -> Path:
        return self.state_dir / "logs"

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


def start_kubelet_node(plane: ControlPlane, state_dir: Path, timeout: float = 120.0) -> KubeletNode:
    """Start containerd and a kubelet joined to `plane`, import the pause image, and wait until
    the Node is Ready. On failure everything started is torn down again."""
    missing = [t for t in ("containerd", "runc", "ctr") if shutil.which(t) is None]
    if missing or not (CNI_BIN_DIR / "bridge").exists():
        raise KubeletNodeError(
            f"missing {', '.join(missing) or CNI_BIN_DIR / 'bridge'}: run ./dev setup (it installs "
            "containerd runc containernetworking-plugins iptables)")
    if Path(f"/sys/class/net/{BRIDGE}").exists():
        raise KubeletNodeError(f"bridge {BRIDGE} exists: is another kubelet node running?")
    kubelet = binaries_dir() / "kubelet"
    if not kubelet.exists():
        raise KubeletNodeError(f"{kubelet} is missing: run hack/build-binaries.sh")
    pause = pause_binary()
    node = KubeletNode(NODE_ADDRESS, state_dir)
    state_dir.mkdir(parents=True, exist_ok=True)
    host.record(node.state_dir)
    try:
        host.make_cgroup_root()
        _write_cni_config(node)
        processes.spawn(_CONTAINERD, ["containerd", f"--config={_write_containerd_config(node)}"],
                        node.pid_dir, node.log_dir)
        _wait_for(lambda: node.containerd_socket.exists() and _ctr_ok(node), timeout,
                  "containerd's socket", node, _CONTAINERD)
        image = write_image(pause, PAUSE_IMAGE, state_dir / "images" / "pause.tar")
        node.ctr("images", "import", "--no-unpack=false", str(image))
        argv = _kubelet_args(kubelet, node, plane)
        processes.spawn(_KUBELET, argv, node.pid_dir, node.log_dir)
        _wait_for(lambda: _node_ready(plane, node.name), timeout, f"node {node.name} Ready",
                  node, _KUBELET)
    except BaseException:
        stop_kubelet_node(plane, node)
        raise
    return node


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


def _write_cni_config(node: KubeletNode) -> None:
    conf_dir = node.state_dir / "cni" / "net.d"
    conf_dir.mkdir(parents=True, exist_ok=True)
    (conf_dir / "10-gemini.conflist").write_text(json.dumps({
        "cniVersion": "1.0.0", "name": "gemini-kubelet",
        "plugins": [{
            # No gateway and no masquerading: pod addresses stay inside their bridge.
            "type": "bridge", "bridge": BRIDGE, "isGateway": False, "ipMasq": False,
            "ipam": {"type": "host-local", "ranges": [[{"subnet": POD_SUBNET}]],
                     "dataDir": str(node.state_dir / "cni" / "ipam")},
        }],
    }, indent=2))


def _write_containerd_config(node: KubeletNode) -> Path:
    d = node.state_dir / "containerd"
    d.mkdir(parents=True, exist_ok=True)
    cri = 'plugins."io.containerd.grpc.v1.cri"'
    config = f"""\
version = 2
root = "{d / 'root'}"
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
        "failCgroupV1": False, "cgroupDriver": "cgroupfs", "cgroupRoot": CGROUP_ROOT,
        "failSwapOn": False, "oomScoreAdj": 0,
        "podLogsDir": str(d / "pod-logs"), "volumePluginDir": str(d / "volume-plugins"),
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
            f"--hostname-override={node.name}", "--v=1"]


# --- teardown ---------------------------------------------------------------------------------

def stop_kubelet_node(plane: ControlPlane, node: KubeletNode) -> list[str]:
    """Delete the node's pods, stop the kubelet and containerd, and undo every host change.

    Returns what could not be undone (empty when the host is as before the start)."""
    problems: list[str] = []
    if processes.running_pid(_KUBELET, node.pid_dir) is not None:
        _delete_pods(plane, node, problems)
    processes.stop(_KUBELET, node.pid_dir, grace_seconds=10)
    if processes.running_pid(_CONTAINERD, node.pid_dir) is not None:
        _kill_tasks(node, problems)
    processes.stop(_CONTAINERD, node.pid_dir, grace_seconds=10)
    _kill_shims(node)
    host.unmount_under(node.state_dir, problems)
    state = host.load(node.state_dir)
    host.remove_netns(set(state.get("netns", [])), problems)
    if Path(f"/sys/class/net/{BRIDGE}").exists():
        host.run(["ip", "link", "delete", BRIDGE], problems)
    host.remove_cgroups(problems)
    if state:
        host.remove_iptables(state, problems)
    host.restore(state, problems)
    with contextlib.suppress(Exception):
        from kubernetes import client

        core = _core(plane)
        core.delete_node(node.name)
        client.RbacAuthorizationV1Api(core.api_client).delete_cluster_role_binding(
            f"gemini-kubelet-{node.name}")
    return problems


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


