"""`gemini demo --with-monitoring`: the chart's monitoring objects on the demo's cluster.

The demo's cluster runs Prometheus configured by the Prometheus Operator
(`gemini local up --with-monitoring`). The demo applies what a Helm install with
`podMonitor.enabled` and `prometheusRule.enabled` would (rendered from the chart, not written
here): the PodMonitor of the workers' sidecars and launchers and the PrometheusRule. Its
operator runs on the host rather than in a pod, so a ScrapeConfig names its metrics port
under the `job` and `namespace` the chart's operatorPodMonitor would give it: the rules and
the dashboard read the same series as in a cluster.
"""

from __future__ import annotations

import subprocess
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from gemini_local.controlplane import built
from gemini_local.monitoring import query

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "gemini-operator"
HELM_BUILD = REPO / "hack" / "build-helm.sh"
RELEASE = "gemini"
SCRAPE_INTERVAL = "2s"
_SHOWN = ("templates/monitoring/podmonitor.yaml", "templates/monitoring/prometheusrule.yaml",
          "templates/monitoring/operator-podmonitor.yaml")


class MonitorsError(RuntimeError):
    """The chart's monitoring objects cannot be rendered or applied; the message says why."""


def _helm() -> Path:
    return built(HELM_BUILD, "helm", MonitorsError)


def rendered(namespace: str) -> list[dict[str, Any]]:
    """The chart's worker PodMonitor, PrometheusRule and operator PodMonitor for a release
    `gemini` in `namespace`, scraped and evaluated every SCRAPE_INTERVAL."""
    command = [str(_helm()), "template", RELEASE, str(CHART), "--namespace", namespace,
               "--set", "podMonitor.enabled=true",
               "--set", f"podMonitor.interval={SCRAPE_INTERVAL}",
               "--set", "operatorPodMonitor.enabled=true", "--set", "prometheusRule.enabled=true",
               *(f"--api-versions=monitoring.coreos.com/v1/{kind}"
                 for kind in ("PodMonitor", "PrometheusRule")),
               *(f"--show-only={path}" for path in _SHOWN)]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise MonitorsError(f"helm template failed: {result.stderr.strip()}")
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def operator_scrape_config(operator_monitor: dict[str, Any], port: int) -> dict[str, Any]:
    """A ScrapeConfig for an operator process on this host's `port`, with the labels the
    chart's `operator_monitor` (its operatorPodMonitor) gives the operator's series."""
    meta = operator_monitor["metadata"]
    (endpoint,) = operator_monitor["spec"]["podMetricsEndpoints"]
    return {
        "apiVersion": "monitoring.coreos.com/v1alpha1", "kind": "ScrapeConfig",
        "metadata": {"name": meta["name"], "namespace": meta["namespace"],
                     "labels": meta.get("labels", {})},
        "spec": {"staticConfigs": [{"targets": [f"127.0.0.1:{port}"],
                                    "labels": {"namespace": meta["namespace"]}}],
                 "metricsPath": endpoint["path"], "scrapeInterval": SCRAPE_INTERVAL,
                 "relabelings": endpoint["relabelings"]},
    }


def objects_for(namespace: str, operator_port: int) -> list[dict[str, Any]]:
    docs = rendered(namespace)
    operator = next(d for d in docs if d["kind"] == "PodMonitor"
                    and d["metadata"]["name"] == f"{RELEASE}-gemini-operator")
    return [d for d in docs if d is not operator] + [
        operator_scrape_config(operator, operator_port)]


def apply(custom: Any, objects: list[dict[str, Any]]) -> list[str]:
    """Create `objects` (CustomObjectsApi `custom`); their kinds and names."""
    plurals = {"PodMonitor": "podmonitors", "PrometheusRule": "prometheusrules",
               "ScrapeConfig": "scrapeconfigs"}
    made = []
    for obj in objects:
        group, version = obj["apiVersion"].split("/")
        custom.create_namespaced_custom_object(group, version, obj["metadata"]["namespace"],
                                               plurals[obj["kind"]], obj)
        made.append(f"{obj['kind']} {obj['metadata']['name']}")
    return made


def scraped(url: str) -> dict[str, Any]:
    """What the demo's Prometheus holds of the run: the targets it scraped by job, the
    recoveries it counted."""
    def instant(expr: str) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = query(
            url, f"/api/v1/query?{urllib.parse.urlencode({'query': expr})}", timeout=10)["result"]
        return result

    # Over the run, not now: a finished job's pods are no longer targets.
    up = {r["metric"].get("job", ""): int(float(r["value"][1]))
          for r in instant("count by (job) (max_over_time(up[1h]) == 1)")}
    recoveries = instant("sum by (cause, source) (gemini_operator_recoveries_finished_total)")
    return {"url": url, "targets_scraped": up,
            "recoveries": {f"{r['metric'].get('cause')}/{r['metric'].get('source')}":
                           float(r["value"][1]) for r in recoveries}}
