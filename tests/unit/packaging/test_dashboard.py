"""The Grafana dashboard only queries metrics the project really exports, and the metrics
follow Prometheus naming (base units, `_total` counters, bounded labels)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.unit.packaging.metrics_registry import (
    exported_sample_names,
    families,
    unread_metrics_modules,
)

ROOT = Path(__file__).resolve().parents[3]
CHART_DASHBOARD = ROOT / "helm" / "gemini-operator" / "dashboards" / "gemini-operator.json"
REPO_DASHBOARD = ROOT / "dashboards" / "gemini-operator.json"
DASHBOARD: dict[str, Any] = json.loads(CHART_DASHBOARD.read_text())

# Words of PromQL that are not metric names when they appear bare.
_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and",
             "or", "unless", "offset", "inf", "nan"}
# Labels whose values are unbounded: a series per step or per object would never end.
_UNBOUNDED_LABELS = {"step", "version", "iteration", "uid", "pod", "ip", "address", "timestamp"}


def panels(items: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in items:
        yield panel
        yield from panels(panel.get("panels", []))


def queries() -> Iterator[tuple[str, str]]:
    """(where, PromQL) of every panel target and every query variable."""
    for panel in panels(DASHBOARD["panels"]):
        for target in panel.get("targets", []):
            yield f"panel {panel['title']!r}", target["expr"]
    for var in DASHBOARD["templating"]["list"]:
        if var["type"] == "query":
            query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            yield f"variable ${var['name']}", query


def metric_names(expr: str) -> set[str]:
    """The series names a PromQL expression selects (label_values(...) included)."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals
    text = re.sub(r"\{[^}]*\}", " ", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", " ", text)  # range selectors
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    text = re.sub(r"\$\{?\w+\}?", " ", text)  # dashboard variables
    text = re.sub(r"label_values\(\s*([a-zA-Z_:][\w:]*)\s*,\s*\w+\s*\)", r" \1 ", text)
    names = re.findall(r"(?<![\w.])([a-zA-Z_:][\w:]*)\b(?!\s*\()", text)
    return {n for n in names if n.lower() not in _KEYWORDS}


def test_the_repository_copy_is_the_charts_file():
    """dashboards/ points into the chart (Helm can only read files inside it): one source."""
    assert REPO_DASHBOARD.resolve() == CHART_DASHBOARD.resolve() or (
        REPO_DASHBOARD.read_bytes() == CHART_DASHBOARD.read_bytes()
    ), "dashboards/gemini-operator.json must be a link to (or a copy of) the chart's dashboard"


def test_every_metrics_module_is_read():
    assert not unread_metrics_modules(), (
        f"add an adapter for {unread_metrics_modules()} to tests/unit/packaging/"
        "metrics_registry.py so its metrics are checked")


def test_metric_name_extraction_understands_promql():
    expr = ('histogram_quantile(0.99, sum by (le, job) (rate(a_seconds_bucket{job=~"$job", '
            'x="y(z)"}[$__rate_interval]))) / on(job) group_left b_total offset 5m')
    assert metric_names(expr) == {"a_seconds_bucket", "b_total"}
    assert metric_names('label_values(c{namespace=~"$namespace"}, job)') == {"c"}


@pytest.mark.parametrize("where, expr", list(queries()))
def test_every_query_names_an_exported_metric(where, expr):
    exported = exported_sample_names()
    names = metric_names(expr)
    assert names, f"{where}: no metric found in {expr!r}"
    unknown = sorted(names - set(exported))
    assert not unknown, f"{where} queries {unknown}, which no metrics module of the project exports"


def test_the_dashboard_covers_sidecar_and_operator_metrics():
    used = {name for _, expr in queries() for name in metric_names(expr)}
    modules = {exported_sample_names()[name].module for name in used}
    assert modules == {f.module for f in families()}, "a component is missing from the dashboard"


def test_panels_have_unique_ids_titles_and_a_datasource_variable():
    every = list(panels(DASHBOARD["panels"]))
    real = [p for p in every if p["type"] != "row"]
    assert len({p["id"] for p in every}) == len(every)
    assert len({p["title"] for p in real}) == len(real)
    assert all(p["datasource"]["uid"] == "${datasource}" for p in real)
    assert all(p.get("description") for p in real), "every panel says what it shows"


@pytest.mark.parametrize("family", list(families()), ids=lambda f: f.name)
def test_metrics_follow_prometheus_naming(family):
    assert family.name.startswith("gemini_"), "one prefix for every metric of the project"
    assert not re.search(r"_(ms|milliseconds|minutes|hours|kb|mb|gb|kib|mib|gib)(_|$)",
                         family.name), "base units only: seconds and bytes"
    if family.type == "histogram":
        assert re.search(r"_(seconds|bytes)$", family.name), "a histogram names its unit"
    if family.type == "gauge":
        assert not family.name.endswith("_total"), "_total is for counters"
    assert not family.labels & _UNBOUNDED_LABELS, (
        f"labels {sorted(family.labels & _UNBOUNDED_LABELS)} are unbounded")
