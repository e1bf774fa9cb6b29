"""A real Prometheus on the local control plane, configured by the real Prometheus Operator
from ServiceMonitors, PodMonitors and PrometheusRules, as a kube-prometheus-stack user's is.

`start_monitoring(plane, state_dir)` installs the monitoring.coreos.com CRDs and runs three
detached processes (built by hack/build-monitoring.sh):

- the Prometheus Operator, against `plane` (its KUBECONFIG);
- Prometheus itself, on the host (loopback), with its lifecycle API on;
- the reloader (`python -m gemini_local.promreload`), Prometheus' config-reloader sidecar's
  part: it copies what the operator generates to the host, rewritten to work outside a pod
  (gemini_local.promconfig), and has Prometheus reload it.

The `Prometheus` resource (monitoring/local) selects every ServiceMonitor, PodMonitor,
PrometheusRule, Probe and ScrapeConfig in every namespace (selectors `{}`, as with the chart's
`...SelectorNilUsesHelmValues: false`). It asks for 0 replicas: there is no Prometheus image
on the nodes, and the operator writes its configuration Secret (prometheus-local) and rule
ConfigMaps (prometheus-local-rulefiles-N) before, and whatever the replicas of, its
StatefulSet, so no pod is needed (none is created, none pends).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from gemini_local import controlplane, processes
from gemini_local.controlplane import REPO_ROOT, ControlPlane

BUILD_SCRIPT = REPO_ROOT / "hack" / "build-monitoring.sh"
NAMESPACE = "monitoring"
PROMETHEUS = "local"  # the Prometheus resource; the operator's objects are prometheus-local*
PROMETHEUS_VERSION = "v3.16.0"  # keep in step with hack/build-monitoring.sh
_OPERATOR, _PROMETHEUS, _RELOADER = "prometheus-operator", "prometheus", "prometheus-reloader"
APPLIED = "applied"  # the reloader's mark: the operator's configuration is loaded


class MonitoringError(RuntimeError):
    """The monitoring stack cannot be built, started or reached; the message says why."""


def bin_dir() -> Path:
    """Directory of the cached prometheus, promtool, prometheus-operator and crds/, building
    them first when missing."""
    return controlplane.built(BUILD_SCRIPT, "Prometheus", MonitoringError)


def promtool() -> Path:
    """The cached promtool (`promtool check rules FILE`, `promtool test rules FILE`)."""
    return bin_dir() / "promtool"


def prometheus_resource(scrape_interval: str, evaluation_interval: str) -> dict[str, Any]:
    """The Prometheus resource: everything selected, everywhere, no pod (see the module)."""
    everything: dict[str, Any] = {f"{kind}{part}": {}
                  for kind in ("serviceMonitor", "podMonitor", "rule", "probe", "scrapeConfig")
                  for part in ("Selector", "NamespaceSelector")}
    return {"apiVersion": "monitoring.coreos.com/v1", "kind": "Prometheus",
            "metadata": {"name": PROMETHEUS, "namespace": NAMESPACE},
            "spec": {"replicas": 0, "version": PROMETHEUS_VERSION,
                     "scrapeInterval": scrape_interval,
                     "evaluationInterval": evaluation_interval, **everything}}


def start_monitoring(plane: ControlPlane, state_dir: Path, scrape_interval: str = "2s",
                     evaluation_interval: str = "2s", timeout: float = 90.0) -> dict[str, Any]:
    """Install the CRDs on `plane` and start the operator, Prometheus and the reloader (pids,
    logs, Prometheus' data and configuration under `state_dir`); once Prometheus runs the
    operator's configuration, return {"url", "operatorURL", "prometheus", "stateDir",
    "pids": {"prometheus-operator", "prometheus", "prometheus-reloader"}}."""
    pid_dir = state_dir / "pids"
    if processes.running_pid(_PROMETHEUS, pid_dir) is not None:
        raise MonitoringError(f"monitoring already runs for {state_dir}; stop_monitoring() it")
    bins = bin_dir()
    controlplane.install_crds(plane, bins / "crds", MonitoringError)
    for obj in ({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}},
                prometheus_resource(scrape_interval, evaluation_interval)):
        kubectl(plane, "apply", "--server-side", "-f", "-", stdin=json.dumps(obj))
    state_dir.mkdir(parents=True, exist_ok=True)
    (state_dir / APPLIED).unlink(missing_ok=True)
    # A new cluster (cluster.up starts etcd afresh): an earlier one's series would mix in.
    shutil.rmtree(state_dir / "data", ignore_errors=True)
    try:
        pids, urls = _start_processes(plane, state_dir, bins, scrape_interval,
                                      evaluation_interval)
        _wait(lambda: (state_dir / APPLIED).exists(), pids, state_dir, timeout,
              "Prometheus running the operator's configuration")
    except BaseException:
        stop_monitoring(state_dir)
        raise
    return {"url": urls[_PROMETHEUS], "operatorURL": urls[_OPERATOR],
            "prometheus": f"{NAMESPACE}/{PROMETHEUS}", "stateDir": str(state_dir),
            "pids": pids}


def _start_processes(plane: ControlPlane, state_dir: Path, bins: Path, scrape_interval: str,
                     evaluation_interval: str) -> tuple[dict[str, int], dict[str, str]]:
    pid_dir, log_dir = state_dir / "pids", state_dir / "logs"
    operator_port, prometheus_port = processes.free_port(), processes.free_port()
    operator = [str(bins / "prometheus-operator"),
                f"--web.listen-address=127.0.0.1:{operator_port}", "--log-level=info"]
    pids = {_OPERATOR: processes.spawn(_OPERATOR, operator, pid_dir, log_dir,
                                       env={**os.environ, "KUBECONFIG": str(plane.kubeconfig)})}
    config = state_dir / "prometheus.yaml"
    # Until the reloader writes the operator's: Prometheus must start with something.
    config.write_text(yaml.safe_dump({"global": {"scrape_interval": scrape_interval,
                                                 "evaluation_interval": evaluation_interval}}))
    pids[_PROMETHEUS] = processes.spawn(_PROMETHEUS, [
        str(bins / "prometheus"), f"--config.file={config}",
        f"--storage.tsdb.path={state_dir / 'data'}", "--storage.tsdb.retention.time=1d",
        f"--web.listen-address=127.0.0.1:{prometheus_port}", "--web.enable-lifecycle",
    ], pid_dir, log_dir)
    url = f"http://127.0.0.1:{prometheus_port}"
    pids[_RELOADER] = processes.spawn(_RELOADER, [
        sys.executable, "-m", "gemini_local.promreload", f"--kubeconfig={plane.kubeconfig}",
        f"--namespace={NAMESPACE}", f"--prometheus={PROMETHEUS}", f"--state-dir={state_dir}",
        f"--config={config}", f"--url={url}",
    ], pid_dir, log_dir)
    return pids, {_PROMETHEUS: url, _OPERATOR: f"http://127.0.0.1:{operator_port}"}


def _wait(done: Callable[[], bool], pids: dict[str, int], state_dir: Path, timeout: float,
          what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for name, pid in pids.items():
            if not processes.is_alive(pid):
                raise MonitoringError(f"{name} exited during start-up; end of its log:\n"
                                      + log_tail(state_dir, name))
        if done():
            return
        time.sleep(0.2)
    raise MonitoringError(f"no {what} after {timeout:.0f}s; end of the reloader's log:\n"
                          + log_tail(state_dir, _RELOADER))


def log_tail(state_dir: Path, name: str, lines: int = 15) -> str:
    log = state_dir / "logs" / f"{name}.log"
    text = log.read_text(errors="replace") if log.exists() else "(no log)"
    return "\n".join(text.splitlines()[-lines:])


def running(state_dir: Path) -> dict[str, int | None]:
    """The pid of each of the three processes, None where it is not running."""
    return {name: processes.running_pid(name, state_dir / "pids")
            for name in (_OPERATOR, _PROMETHEUS, _RELOADER)}


def stop_monitoring(state_dir: Path) -> bool:
    """Stop the reloader, Prometheus and the operator; False if none was running. The CRDs,
    the Prometheus resource and Prometheus' data stay (until the next start)."""
    pid_dir = state_dir / "pids"
    return any([processes.stop(name, pid_dir) for name in (_RELOADER, _PROMETHEUS, _OPERATOR)])


def kubectl(plane: ControlPlane, *args: str, stdin: str | None = None) -> str:
    return controlplane.kubectl(plane, *args, stdin=stdin, error=MonitoringError)


def query(url: str, path: str, timeout: float = 5.0) -> Any:
    """GET Prometheus' HTTP API at `url` + `path` (e.g. /api/v1/targets); its `data`."""
    try:
        with urllib.request.urlopen(url + path, timeout=timeout) as resp:
            body = json.load(resp)
    except (urllib.error.URLError, OSError, ValueError) as err:
        raise MonitoringError(f"GET {url}{path}: {err}") from err
    if body.get("status") != "success":
        raise MonitoringError(f"GET {url}{path}: {body.get('error', body)}")
    return body["data"]
