"""The local Kubernetes control plane: etcd, kube-apiserver, kube-controller-manager, scheduler.

Real binaries (built from Go modules by hack/build-binaries.sh) run as detached processes on
loopback, with a generated PKI and RBAC on. All state (PKI, etcd data, logs, pids, kubeconfigs,
ports) lives in one directory, so `stop_control_plane` and a later status need nothing else.
"""

from __future__ import annotations

import json
import os
import shutil
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from gemini_local import processes
from gemini_local.pki import Pki

COMPONENTS = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler")
REPO_ROOT = Path(__file__).resolve().parents[2]
BUILD_SCRIPT = REPO_ROOT / "hack" / "build-binaries.sh"
SERVICE_CIDR = "10.0.0.0/24"
NODE_GRACE_ENV = "GEMINI_NODE_MONITOR_GRACE_SECONDS"


def cache_root() -> Path:
    """Where builds and images outlive a clone: $GEMINI_CACHE, else ~/.cache/gemini-operator."""
    return Path(os.environ.get("GEMINI_CACHE", Path.home() / ".cache" / "gemini-operator"))


class ControlPlaneError(RuntimeError):
    """The control plane cannot be started, stopped or reached; the message says why."""


@dataclass(frozen=True)
class Ports:
    etcd_client: int
    etcd_peer: int
    apiserver: int
    controller_manager: int
    scheduler: int

    @staticmethod
    def pick() -> Ports:
        return Ports(*(processes.free_port() for _ in range(5)))


@dataclass(frozen=True)
class ControlPlane:
    state_dir: Path
    ports: Ports
    kubeconfig: Path
    pki: Pki

    @property
    def api_url(self) -> str:
        return f"https://127.0.0.1:{self.ports.apiserver}"

    @property
    def pid_dir(self) -> Path:
        return self.state_dir / "pids"

    @property
    def log_dir(self) -> Path:
        return self.state_dir / "logs"

    @staticmethod
    def load(state_dir: Path) -> ControlPlane | None:
        """The control plane recorded in `state_dir`, or None if it was never started there."""
        meta = state_dir / "controlplane.json"
        if not meta.exists():
            return None
        ports = Ports(**json.loads(meta.read_text())["ports"])
        return ControlPlane(state_dir, ports, state_dir / "kubeconfig", Pki(state_dir / "pki"))


def built(script: Path, what: str, error: type[Exception] = ControlPlaneError) -> Path:
    """What a hack/build-*.sh script prints on its last line (the cached build's path),
    running it first: it builds when the cache lacks the build (minutes, cold), else returns
    at once. Its progress goes to stderr as it runs."""
    result = subprocess.run(["bash", str(script)], stdout=subprocess.PIPE, text=True,
                            check=False)
    if result.returncode != 0:
        raise error(f"building {what} failed (exit {result.returncode}); see the output above, "
                    f"or run {script} directly (needs Go >= 1.26)")
    return Path(result.stdout.strip().splitlines()[-1])


def binaries_dir() -> Path:
    """Directory of the cached binaries, building them first when missing (minutes, cold)."""
    if shutil.which("go") is None and not _cached_bin_dir_hint():
        raise ControlPlaneError(
            "the control-plane binaries are not built and Go is not installed: "
            "install Go >= 1.25 (e.g. apt-get install golang-go) and run ./dev setup"
        )
    return built(BUILD_SCRIPT, "the control plane")


def kubectl(plane: ControlPlane, *args: str, stdin: str | None = None,
            error: type[Exception] = ControlPlaneError) -> str:
    """kubectl against `plane`: its output, or `error` naming the command and kubectl's own
    words."""
    argv = [str(binaries_dir() / "kubectl"), f"--kubeconfig={plane.kubeconfig}", *args]
    result = subprocess.run(argv, input=stdin, capture_output=True, text=True, check=False,
                            timeout=120)
    if result.returncode != 0:
        raise error(f"kubectl {' '.join(args[:2])} failed: {result.stderr.strip()}")
    return result.stdout


def install_crds(plane: ControlPlane, crds: Path,
                 error: type[Exception] = ControlPlaneError) -> None:
    """Every CRD in `crds` (files named <group>_<plural>.yaml, as controller-gen writes
    them), established before this returns."""
    # Server-side: large CRDs do not fit client-side apply's last-applied annotation.
    kubectl(plane, "apply", "--server-side", "--force-conflicts", "-f", str(crds), error=error)
    names = [".".join(reversed(p.stem.split("_", 1))) for p in sorted(crds.glob("*.yaml"))]
    kubectl(plane, "wait", "--for=condition=Established", "--timeout=60s",
            *(f"crd/{name}" for name in names), error=error)


def _cached_bin_dir_hint() -> bool:
    return any(p.joinpath("kube-apiserver").exists()
               for p in (cache_root() / "bin").glob("k8s-*"))


def running_components(state_dir: Path) -> dict[str, int | None]:
    """Each component's pid, or None when it is not running."""
    return {c: processes.running_pid(c, state_dir / "pids") for c in COMPONENTS}


def start_control_plane(
    state_dir: Path, timeout: float = 60.0, node_monitor_grace_seconds: int | None = None,
) -> ControlPlane:
    """Start all four components and wait until the API server is ready for pods.

    `node_monitor_grace_seconds`: how long a silent node stays Ready; thousands of kwok nodes
    need more than the default 8 s (see tools/gemini_local/kwok.py). None: the environment's
    GEMINI_NODE_MONITOR_GRACE_SECONDS, else 8 (Kubernetes' own default is 40: measure with it
    to see what does not rest on the short one).
    """
    if node_monitor_grace_seconds is None:
        node_monitor_grace_seconds = int(os.environ.get(NODE_GRACE_ENV) or 8)
    alive = [c for c, pid in running_components(state_dir).items() if pid is not None]
    if alive:
        raise ControlPlaneError(
            f"a local cluster is already running in {state_dir} ({', '.join(alive)}); "
            "use `gemini local status`, or `gemini local down` first"
        )
    bins = binaries_dir()
    state_dir.mkdir(parents=True, exist_ok=True)
    plane = ControlPlane(state_dir, Ports.pick(), state_dir / "kubeconfig", Pki(state_dir / "pki"))
    (state_dir / "controlplane.json").write_text(json.dumps({"ports": plane.ports.__dict__}))
    _write_kubeconfigs(plane)
    try:
        _start(plane, "etcd", _etcd_args(bins, plane))
        _wait(f"http://127.0.0.1:{plane.ports.etcd_client}/health", "etcd", plane, timeout)
        _start(plane, "kube-apiserver", _apiserver_args(bins, plane))
        _wait(f"{plane.api_url}/readyz", "kube-apiserver", plane, timeout)
        _start(plane, "kube-controller-manager",
               _controller_manager_args(bins, plane, node_monitor_grace_seconds))
        _start(plane, "kube-scheduler", _scheduler_args(bins, plane))
        _wait(f"https://127.0.0.1:{plane.ports.controller_manager}/healthz",
              "kube-controller-manager", plane, timeout)
        _wait(f"https://127.0.0.1:{plane.ports.scheduler}/healthz", "kube-scheduler", plane,
              timeout)
        _wait_for_default_service_account(plane, timeout)
    except Exception:
        stop_control_plane(state_dir)
        raise
    return plane


def stop_control_plane(state_dir: Path) -> list[str]:
    """Stop every component (reverse start order); return the names that were running."""
    pid_dir = state_dir / "pids"
    return [c for c in reversed(COMPONENTS) if processes.stop(c, pid_dir)]


def _start(plane: ControlPlane, name: str, argv: list[str]) -> None:
    processes.spawn(name, argv, plane.pid_dir, plane.log_dir)


def _wait(url: str, name: str, plane: ControlPlane, timeout: float) -> None:
    if name == "kube-apiserver":
        ctx = ssl.create_default_context(cafile=str(plane.pki.ca_cert))
    else:  # KCM and the scheduler serve self-signed certificates on their health port
        ctx = ssl._create_unverified_context()
    deadline = time.monotonic() + timeout
    last_error = ""
    while time.monotonic() < deadline:
        if processes.running_pid(name, plane.pid_dir) is None:
            log = plane.log_dir / f"{name}.log"
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-5:])
            raise ControlPlaneError(f"{name} exited during start-up; end of {log}:\n{tail}")
        try:
            with urllib.request.urlopen(url, timeout=2, context=ctx) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, OSError) as err:
            last_error = str(err)
        time.sleep(0.1)
    raise ControlPlaneError(
        f"{name} not healthy after {timeout:.0f}s ({last_error}); "
        f"see {plane.log_dir / (name + '.log')}"
    )


def _wait_for_default_service_account(plane: ControlPlane, timeout: float) -> None:
    """Pods are refused until KCM creates the `default` ServiceAccount; wait for it."""
    from kubernetes import client, config

    api = client.CoreV1Api(config.new_client_from_config(str(plane.kubeconfig)))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            api.read_namespaced_service_account("default", "default")
            return
        except client.ApiException:
            time.sleep(0.2)
    raise ControlPlaneError("the default ServiceAccount never appeared; is kube-controller-"
                            f"manager healthy? see {plane.log_dir}")


def _write_kubeconfigs(plane: ControlPlane) -> None:
    identities = {
        "kubeconfig": ("admin", "admin", ("system:masters",)),
        "controller-manager.kubeconfig": (
            "controller-manager", "system:kube-controller-manager", ()),
        "scheduler.kubeconfig": ("scheduler", "system:kube-scheduler", ()),
    }
    for filename, (cert_name, user, groups) in identities.items():
        cert, key = plane.pki.issue(f"{cert_name}-client", user, groups, client=True)
        (plane.state_dir / filename).write_text(_kubeconfig(plane, user, cert, key))


def _kubeconfig(plane: ControlPlane, user: str, cert: Path, key: Path) -> str:
    return json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "gemini-local",
        "clusters": [{"name": "gemini-local", "cluster": {
            "server": plane.api_url, "certificate-authority": str(plane.pki.ca_cert)}}],
        "users": [{"name": user, "user": {
            "client-certificate": str(cert), "client-key": str(key)}}],
        "contexts": [{"name": "gemini-local", "context": {
            "cluster": "gemini-local", "user": user, "namespace": "default"}}],
    }, indent=2)


def _etcd_args(bins: Path, plane: ControlPlane) -> list[str]:
    client = f"http://127.0.0.1:{plane.ports.etcd_client}"
    peer = f"http://127.0.0.1:{plane.ports.etcd_peer}"
    return [
        str(bins / "etcd"), "--name=gemini-local",
        f"--data-dir={plane.state_dir / 'etcd-data'}",
        f"--listen-client-urls={client}", f"--advertise-client-urls={client}",
        f"--listen-peer-urls={peer}", f"--initial-advertise-peer-urls={peer}",
        f"--initial-cluster=gemini-local={peer}",
        "--unsafe-no-fsync=true", "--log-level=warn", "--quota-backend-bytes=4294967296",
    ]


def _apiserver_args(bins: Path, plane: ControlPlane) -> list[str]:
    pki = plane.pki
    serving_cert, serving_key = pki.issue(
        "apiserver", "kube-apiserver", ips=("127.0.0.1", "10.0.0.1"),
        dns=("localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc",
             "kubernetes.default.svc.cluster.local"),
        server=True,
    )
    kubelet_cert, kubelet_key = pki.issue(
        "apiserver-kubelet-client", "kube-apiserver-kubelet-client", ("system:masters",),
        client=True,
    )
    return [
        str(bins / "kube-apiserver"),
        f"--etcd-servers=http://127.0.0.1:{plane.ports.etcd_client}",
        f"--secure-port={plane.ports.apiserver}", "--bind-address=127.0.0.1",
        "--advertise-address=127.0.0.1",
        f"--tls-cert-file={serving_cert}", f"--tls-private-key-file={serving_key}",
        f"--client-ca-file={pki.ca_cert}",
        f"--service-cluster-ip-range={SERVICE_CIDR}", "--allow-privileged=true",
        "--authorization-mode=RBAC",
        f"--service-account-issuer=https://127.0.0.1:{plane.ports.apiserver}/",
        f"--service-account-key-file={pki.service_account_pub}",
        f"--service-account-signing-key-file={pki.service_account_key}",
        f"--kubelet-client-certificate={kubelet_cert}", f"--kubelet-client-key={kubelet_key}",
        "--kubelet-preferred-address-types=InternalIP",
        # Pods on a lost node are evicted after 5 s instead of the default 5 min.
        "--default-not-ready-toleration-seconds=5",
        "--default-unreachable-toleration-seconds=5",
        "--profiling=false", "--v=1",
    ]


def _controller_manager_args(
    bins: Path, plane: ControlPlane, node_monitor_grace_seconds: int = 8,
) -> list[str]:
    return [
        str(bins / "kube-controller-manager"),
        f"--kubeconfig={plane.state_dir / 'controller-manager.kubeconfig'}",
        f"--authentication-kubeconfig={plane.state_dir / 'controller-manager.kubeconfig'}",
        f"--authorization-kubeconfig={plane.state_dir / 'controller-manager.kubeconfig'}",
        "--leader-elect=false", "--use-service-account-credentials=true",
        f"--root-ca-file={plane.pki.ca_cert}",
        f"--service-account-private-key-file={plane.pki.service_account_key}",
        f"--cluster-signing-cert-file={plane.pki.ca_cert}",
        f"--cluster-signing-key-file={plane.pki.ca_key}",
        f"--service-cluster-ip-range={SERVICE_CIDR}",
        # Fast node-lifecycle: a silent node is marked Unknown 8 s (by default) after its last
        # heartbeat.
        "--node-monitor-period=1s", f"--node-monitor-grace-period={node_monitor_grace_seconds}s",
        f"--secure-port={plane.ports.controller_manager}", "--bind-address=127.0.0.1",
        "--profiling=false", "--v=1",
    ]


def _scheduler_args(bins: Path, plane: ControlPlane) -> list[str]:
    kubeconfig = plane.state_dir / "scheduler.kubeconfig"
    return [
        str(bins / "kube-scheduler"), f"--kubeconfig={kubeconfig}",
        f"--authentication-kubeconfig={kubeconfig}", f"--authorization-kubeconfig={kubeconfig}",
        "--leader-elect=false",
        f"--secure-port={plane.ports.scheduler}", "--bind-address=127.0.0.1",
        "--profiling=false", "--v=1",
    ]
