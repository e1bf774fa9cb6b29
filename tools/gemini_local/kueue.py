"""Kueue (sigs.k8s.io/kueue) on the local control plane: job queueing and all-or-nothing
admission for GeminiJobs (the operator's queueing.py).

`start_kueue(plane, state_dir)` installs Kueue's CRDs and runs its controller manager
(built by hack/build-kueue.sh) as one detached process against `plane`. Its webhooks are not
registered with the API server (nothing here needs Kueue to default or check objects: the
operator writes complete Workloads); their server still runs, on a certificate from the
cluster's CA. Only the `batch/job` integration is on: GeminiJobs are integrated by the
operator itself, as an external job framework. `queue_setup` writes a ResourceFlavor, a
ClusterQueue and a LocalQueue, the smallest set that admits anything.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gemini_local import controlplane, processes
from gemini_local.controlplane import REPO_ROOT, ControlPlane

BUILD_SCRIPT = REPO_ROOT / "hack" / "build-kueue.sh"
_NAME = "kueue"
FEATURE_GATES = "VisibilityOnDemand=false"  # its aggregated API needs a Service: not here
METRICS_CERTS = Path("/etc/kueue/metrics/certs")


class KueueError(RuntimeError):
    """Kueue cannot be built, started or reached; the message says why."""


def kueue_bin_dir() -> Path:
    """Directory of the cached Kueue binary and CRDs, building them first when missing."""
    return controlplane.built(BUILD_SCRIPT, "Kueue", KueueError)


def kueue_config(webhook_port: int, health_port: int, cert_dir: Path,
                 pods_ready_timeout: int | None = None) -> dict[str, Any]:
    """Kueue's configuration; with `pods_ready_timeout`, its waitForPodsReady: a workload
    whose pods are not all ready that many seconds after admission is evicted and requeued
    (after 5 s, doubling)."""
    wait = {"waitForPodsReady": {
        "timeout": f"{pods_ready_timeout}s", "blockAdmission": False,
        "requeuingStrategy": {"timestamp": "Eviction", "backoffBaseSeconds": 5}},
    } if pods_ready_timeout else {}
    return {**wait,
        "apiVersion": "config.kueue.x-k8s.io/v1beta2", "kind": "Configuration",
        "namespace": "kueue-system",
        "health": {"healthProbeBindAddress": f"127.0.0.1:{health_port}"},
        "metrics": {"bindAddress": "0"},
        "webhook": {"port": webhook_port, "host": "127.0.0.1", "certDir": str(cert_dir)},
        "leaderElection": {"leaderElect": False},
        "internalCertManagement": {"enable": False},
        "integrations": {"frameworks": ["batch/job"]},
    }


def start_kueue(plane: ControlPlane, state_dir: Path, timeout: float = 90.0,
                pods_ready_timeout: int | None = None) -> int:
    """Install Kueue's CRDs on `plane` and start its controller manager (pid, log and config
    under `state_dir`; `pods_ready_timeout`: see kueue_config); return its pid once it
    reports ready."""
    pid_dir, log_dir = state_dir / "pids", state_dir / "logs"
    if processes.running_pid(_NAME, pid_dir) is not None:
        raise KueueError(f"Kueue is already running for {state_dir}; stop_kueue() it first")
    bin_dir = kueue_bin_dir()
    controlplane.install_crds(plane, bin_dir / "crds", KueueError)
    kubectl_apply(plane, {"apiVersion": "v1", "kind": "Namespace",
                          "metadata": {"name": "kueue-system"}})
    state_dir.mkdir(parents=True, exist_ok=True)
    cert_dir = state_dir / "kueue-etc" / METRICS_CERTS.name
    cert_dir.mkdir(parents=True, exist_ok=True)
    cert, key = plane.pki.issue("kueue-webhook", "kueue-webhook", ips=["127.0.0.1"], server=True)
    shutil.copy(cert, cert_dir / "tls.crt")
    shutil.copy(key, cert_dir / "tls.key")
    health = processes.free_port()
    config = state_dir / "kueue-config.yaml"
    config.write_text(json.dumps(kueue_config(processes.free_port(), health, cert_dir,
                                              pods_ready_timeout)))
    kueue = [str(bin_dir / "kueue"), f"--config={config}", f"--kubeconfig={plane.kubeconfig}",
             f"--feature-gates={FEATURE_GATES}", "--zap-log-level=info"]
    argv = _with_metrics_certs(kueue, cert_dir)
    pid = processes.spawn(_NAME, argv, pid_dir, log_dir)
    # unshare and sh exec Kueue in the same process: record it by what it runs at the end.
    processes.record(_NAME, pid, kueue[0], pid_dir)
    log = log_dir / f"{_NAME}.log"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not processes.is_alive(pid):
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
            raise KueueError(f"Kueue exited during start-up; end of {log}:\n{tail}")
        if _ready(health):
            return pid
        time.sleep(0.3)
    stop_kueue(state_dir)
    raise KueueError(f"Kueue not ready after {timeout:.0f}s; see {log}")


def _with_metrics_certs(argv: list[str], cert_dir: Path) -> list[str]:
    """`argv` run where /etc/kueue/metrics/certs holds a certificate: without its internal
    cert management Kueue reads its metrics certificate from that fixed path (its Deployment
    mounts a Secret there), even with metrics off. A private mount namespace binds `cert_dir`
    there for Kueue alone; the host keeps only the empty mount point /etc/kueue/metrics."""
    if os.geteuid() != 0:
        raise KueueError("running Kueue here needs root (a private mount namespace for its "
                         "fixed certificate path); run as root, as ./dev does")
    METRICS_CERTS.parent.mkdir(parents=True, exist_ok=True)
    script = (f'mount --bind "$1" {METRICS_CERTS.parent} && shift && exec "$@"')
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh",
            str(cert_dir.parent), *argv]


def stop_kueue(state_dir: Path) -> bool:
    """Stop Kueue; False if it was not running. Its CRDs and objects stay."""
    return processes.stop(_NAME, state_dir / "pids")


def queue_setup(plane: ControlPlane, namespace: str, queue: str,
                quota: Mapping[str, str], flavor: str = "default-flavor",
                node_labels: Mapping[str, str] | None = None,
                preemption: Mapping[str, str] | None = None) -> None:
    """A ResourceFlavor, a ClusterQueue `queue` with `quota` (resource -> nominal quota, every
    resource the workloads request; `preemption` as Kueue's ClusterQueue takes it) and a
    LocalQueue `queue` in `namespace` pointing at it."""
    resources = [{"name": name, "nominalQuota": value} for name, value in quota.items()]
    objects = [
        {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ResourceFlavor",
         "metadata": {"name": flavor},
         "spec": {"nodeLabels": dict(node_labels)} if node_labels else {}},
        {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ClusterQueue",
         "metadata": {"name": queue},
         "spec": {"namespaceSelector": {}, "resourceGroups": [{
             "coveredResources": list(quota),
             "flavors": [{"name": flavor, "resources": resources}]}],
             **({"preemption": dict(preemption)} if preemption else {})}},
        {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "LocalQueue",
         "metadata": {"name": queue, "namespace": namespace},
         "spec": {"clusterQueue": queue}},
    ]
    for obj in objects:
        kubectl_apply(plane, obj)


def priority_class(plane: ControlPlane, name: str, value: int) -> None:
    """A Kueue WorkloadPriorityClass (label a job `kueue.x-k8s.io/priority-class: name`)."""
    kubectl_apply(plane, {"apiVersion": "kueue.x-k8s.io/v1beta2",
                          "kind": "WorkloadPriorityClass", "metadata": {"name": name},
                          "value": value})


def kubectl_apply(plane: ControlPlane, obj: Mapping[str, Any]) -> None:
    kubectl(plane, "apply", "--server-side", "-f", "-", stdin=json.dumps(obj))


def kubectl(plane: ControlPlane, *args: str, stdin: str | None = None) -> str:
    return controlplane.kubectl(plane, *args, stdin=stdin, error=KueueError)


def _ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2) as resp:
            return bool(resp.status == 200)
    except (urllib.error.URLError, OSError):
        return False
