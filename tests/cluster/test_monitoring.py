"""A real Prometheus, configured by the real Prometheus Operator (`gemini local up
--with-monitoring`), picks up a ServiceMonitor, a PodMonitor and a PrometheusRule from any
namespace, as a kube-prometheus-stack user's does: it scrapes a pod on a node agent through
both and fires the rule's alert. Everything is read back through Prometheus' HTTP API.

A node agent's pod has a loopback IP, which the API server refuses in Endpoints and
EndpointSlices ("may not be in the loopback range"): the endpoint controllers cannot list it
behind a Service, so no ServiceMonitor finds it. The Service here has no selector, and the test
writes its Endpoints, as for a target outside the cluster: the pod's port at the host's own
(non-loopback) address, with the pod as its targetRef (Prometheus adds the pod's labels).
Endpoints, not an EndpointSlice: the operator's default service discovery role (as a
kube-prometheus-stack user's) reads them. On kubelet nodes, pods have bridge addresses and the
endpoint controllers list them themselves."""

from __future__ import annotations

import json
import subprocess
import textwrap
from typing import Any
from urllib.parse import urlencode

import pytest

from gemini_local import monitoring
from gemini_local.controlplane import binaries_dir
from gemini_local.processes import free_port
from tests.fixtures.nodes import LocalCluster, wait_until

pytestmark = pytest.mark.cluster

Obj = dict[str, Any]
APP = {"app": "metrics-demo"}

# A pod that serves one counter in Prometheus' text format on port $PORT of every address.
SERVER = textwrap.dedent("""
    import http.server, os
    class Metrics(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = b"# TYPE demo_requests_total counter\\ndemo_requests_total 7\\n"
            self.send_response(200 if self.path == "/metrics" else 404)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.end_headers()
            self.wfile.write(body)
        def log_message(self, *args):
            pass
    # Every address: the Endpoints name the host's (see the module's docstring).
    http.server.HTTPServer(("0.0.0.0", int(os.environ["PORT"])), Metrics).serve_forever()
""")


def host_address() -> str:
    """The host's first global IPv4 address (the API server refuses loopback endpoints)."""
    out = subprocess.run(["ip", "-j", "-4", "addr", "show", "scope", "global"], check=True,
                         capture_output=True, text=True).stdout
    addresses = [a["local"] for link in json.loads(out) for a in link.get("addr_info", [])]
    assert addresses, "this host has no global IPv4 address for the Service's EndpointSlice"
    return str(addresses[0])


def objects(ns: str, address: str, port_number: int) -> list[Obj]:
    """The pod, a Service and its Endpoints at `address`, a ServiceMonitor and a PodMonitor of
    it, and an always-firing rule."""
    port = {"name": "metrics", "containerPort": port_number}
    meta = {"name": "metrics-demo", "namespace": ns, "labels": APP}
    return [
        {"apiVersion": "v1", "kind": "Pod", "metadata": meta,
         "spec": {"terminationGracePeriodSeconds": 1, "containers": [
             {"name": "server", "image": "python", "command": ["python", "-u", "-c", SERVER],
              "env": [{"name": "PORT", "value": str(port_number)}], "ports": [port]}]}},
        {"apiVersion": "v1", "kind": "Service", "metadata": meta,
         "spec": {"ports": [{"name": "metrics", "port": port_number}]}},
        {"apiVersion": "v1", "kind": "Endpoints", "metadata": meta, "subsets": [{
            "addresses": [{"ip": address, "targetRef": {"kind": "Pod", "name": "metrics-demo",
                                                        "namespace": ns}}],
            "ports": [{"name": "metrics", "port": port_number}]}]},
        {"apiVersion": "monitoring.coreos.com/v1", "kind": "ServiceMonitor", "metadata": meta,
         "spec": {"selector": {"matchLabels": APP}, "endpoints": [{"port": "metrics"}]}},
        {"apiVersion": "monitoring.coreos.com/v1", "kind": "PodMonitor", "metadata": meta,
         "spec": {"selector": {"matchLabels": APP},
                  "podMetricsEndpoints": [{"port": "metrics"}]}},
        {"apiVersion": "monitoring.coreos.com/v1", "kind": "PrometheusRule", "metadata": meta,
         "spec": {"groups": [{"name": "demo", "rules": [
             {"alert": "DemoAlwaysFiring", "expr": "vector(1)",
              "labels": {"severity": "none"}}]}]}},
    ]


def apply(cluster: LocalCluster, objs: list[Obj]) -> None:
    subprocess.run([str(binaries_dir() / "kubectl"), f"--kubeconfig={cluster.kubeconfig}",
                    "apply", "-f", "-"], input=json.dumps({"apiVersion": "v1", "kind": "List",
                                                           "items": objs}),
                   text=True, check=True, capture_output=True)


def up_targets(url: str, ns: str) -> dict[str, Obj]:
    """The healthy scrape targets in `ns`, by their job label."""
    targets = monitoring.query(url, "/api/v1/targets?state=active")["activeTargets"]
    return {t["labels"]["job"]: t for t in targets
            if t["labels"].get("namespace") == ns and t["health"] == "up"}


def firing(url: str, name: str) -> list[Obj]:
    alerts = monitoring.query(url, "/api/v1/alerts")["alerts"]
    return [a for a in alerts if a["labels"]["alertname"] == name and a["state"] == "firing"]


@pytest.mark.proves("prometheus-scrape")
def test_monitors_and_rules_are_picked_up(local_cluster: LocalCluster, namespace: str,
                                          prometheus: dict[str, Any]) -> None:
    url = prometheus["url"]
    port = free_port("0.0.0.0")
    apply(local_cluster, objects(namespace, host_address(), port))

    # The ServiceMonitor's job is the Service's name; the PodMonitor's is namespace/name.
    jobs = {"metrics-demo", f"{namespace}/metrics-demo"}
    targets = wait_until(lambda: (t := up_targets(url, namespace)).keys() >= jobs and t, 40,
                         "both targets up", interval=0.5)
    for job in jobs:
        assert targets[job]["labels"]["pod"] == "metrics-demo"
        assert targets[job]["labels"]["namespace"] == namespace
        assert targets[job]["scrapeUrl"].endswith(f":{port}/metrics")
    assert targets["metrics-demo"]["labels"]["service"] == "metrics-demo"
    query = urlencode({"query": f'demo_requests_total{{namespace="{namespace}"}}'})
    sample = monitoring.query(url, f"/api/v1/query?{query}")
    assert {r["metric"]["job"] for r in sample["result"]} == jobs
    assert all(r["value"][1] == "7" for r in sample["result"])

    alerts = wait_until(lambda: firing(url, "DemoAlwaysFiring"), 20, "the alert firing",
                        interval=0.5)
    assert alerts[0]["labels"]["severity"] == "none"
