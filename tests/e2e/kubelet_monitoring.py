"""The kubelet nodes' Prometheus (`gemini local up --with-monitoring`: the Prometheus Operator
turns the chart's monitors and rules into Prometheus' configuration) as the e2e cases read it:
the chart's values that turn monitoring on, every dashboard panel answered for a job, and an
alert seen firing and cleared.
"""

from __future__ import annotations

import time
from typing import Any

from tests.fixtures.nodes import wait_until
from tests.fixtures.prometheus import PanelResult, Prometheus, dashboard_results

S3_FAILING = "GeminiJobS3PersistenceFailing"
# The S3-failing alert fires at its first evaluation after a failure is scraped and clears this
# long after the last one (the stock 10m window and 15m `for` would outlast the test).
S3_FAILING_WINDOW = "20s"
SCRAPE = "2s"

# The operator runs on its node's network here, whose loopback address a Service's endpoints
# cannot carry: the operator's pods are scraped by the chart's operatorPodMonitor instead of its
# ServiceMonitor (same `job`, so the rules and the dashboard read the same series).
HELM_VALUES = [
    "--set", "operatorPodMonitor.enabled=true", "--set", f"operatorPodMonitor.interval={SCRAPE}",
    "--set", "podMonitor.enabled=true", "--set", f"podMonitor.interval={SCRAPE}",
    "--set", "prometheusRule.enabled=true",
    "--set", "prometheusRule.alerts.s3PersistenceFailing.for=0",
    "--set", f"prometheusRule.alerts.s3PersistenceFailing.window={S3_FAILING_WINDOW}",
]


def prometheus_of(cluster_info: dict[str, Any]) -> Prometheus:
    monitoring = cluster_info.get("monitoring")
    assert monitoring, f"the cluster was started without monitoring: {cluster_info}"
    return Prometheus(monitoring["url"])


def firing_for(prometheus: Prometheus, alert: str, job: str) -> list[dict[str, Any]]:
    return [a for a in prometheus.firing(alert) if a["labels"].get("geminijob") == job]


def wait_firing(prometheus: Prometheus, alert: str, job: str, timeout: float = 60
                ) -> dict[str, Any]:
    alerts = wait_until(lambda: firing_for(prometheus, alert, job), timeout,
                        f"{alert} to fire for {job}", interval=1)
    return alerts[0]  # type: ignore[no-any-return]


def wait_cleared(prometheus: Prometheus, alert: str, job: str, timeout: float = 90) -> None:
    wait_until(lambda: not [a for a in prometheus.alerts()
                            if a["labels"].get("alertname") == alert
                            and a["labels"].get("geminijob") == job], timeout,
               f"{alert} to clear for {job}", interval=1)


def panels_answer(prometheus: Prometheus, namespace: str, job: str) -> list[PanelResult]:
    """Every panel and variable query of the dashboard for `job`, evaluated now; a query that
    returns no series fails (a missing series is not a 0)."""
    at = time.time()
    results = list(dashboard_results(prometheus, {"namespace": namespace, "job": job}, at,
                                     window=600, rate_interval="2m"))
    empty = [f"{r.where}: {r.expr}" for r in results if not r.series]
    assert not empty, "dashboard queries with no series:\n" + "\n".join(empty)
    return results


def panel_value(results: list[PanelResult], title: str, **labels: str) -> float:
    """The value of the one series of panel `title` that carries `labels`."""
    (value,) = [float(s["value"][1]) for r in results if r.where == f"panel {title!r}"
                for s in r.series if labels.items() <= s["metric"].items()]
    return value


def recoveries_counted(prometheus: Prometheus) -> dict[tuple[str, str], float]:
    """The operator's finished recoveries by (cause, source), as Prometheus scraped them."""
    series = prometheus.query(
        "sum by (cause, source) (gemini_operator_recoveries_finished_total)")
    return {(s["metric"]["cause"], s["metric"]["source"]): float(s["value"][1]) for s in series}
