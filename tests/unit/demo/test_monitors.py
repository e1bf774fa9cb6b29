"""`gemini demo --with-monitoring` applies the chart's own monitoring objects (rendered by the
real helm), and scrapes its host-process operator under the labels the chart's rules select."""

from __future__ import annotations

from gemini_demo import monitors


def test_the_demo_applies_the_charts_monitors_and_rules_and_scrapes_its_operator_alike():
    objects = monitors.objects_for("gemini-demo", 4321)
    kinds = sorted(o["kind"] for o in objects)
    assert kinds == ["PodMonitor", "PrometheusRule", "ScrapeConfig"], kinds
    assert all(o["metadata"]["namespace"] == "gemini-demo" for o in objects)
    scrape = next(o for o in objects if o["kind"] == "ScrapeConfig")
    (static,) = scrape["spec"]["staticConfigs"]
    assert static == {"targets": ["127.0.0.1:4321"], "labels": {"namespace": "gemini-demo"}}
    (relabel,) = scrape["spec"]["relabelings"]
    # The rules select the operator's series by that job and namespace.
    rule = next(o for o in objects if o["kind"] == "PrometheusRule")
    down = next(r for g in rule["spec"]["groups"] for r in g["rules"]
                if r.get("alert") == "GeminiOperatorDown")
    assert f'job="{relabel["replacement"]}", namespace="gemini-demo"' in down["expr"]
    workers = next(o for o in objects if o["kind"] == "PodMonitor")
    assert {e["port"] for e in workers["spec"]["podMetricsEndpoints"]} == {"sidecar-api",
                                                                             "launcher"}
    assert all(e["interval"] == monitors.SCRAPE_INTERVAL
               for e in workers["spec"]["podMetricsEndpoints"])
