"""The Grafana dashboard only queries metrics the project really exports, selects per-job
series by the labels they really carry, and the metrics follow Prometheus naming (base units,
`_total` counters, bounded labels, no label a scrape sets itself)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gemini.metric_labels import JOB, JOB_NAMESPACE, RANK, TARGET_LABELS
from tests.unit.packaging.metrics_registry import (
    ADAPTERS,
    Family,
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
# A build-info series names what runs: one version per process.
_BUILD_LABELS = {"version", "python_version"}
# Every series of a sidecar or a launcher is about one rank of one GeminiJob.
_PER_RANK = {"trainer_sidecar/gemini_sidecar/metrics.py",
             "trainer_sidecar/gemini_trainer/launcher_metrics.py"}
_BUILD_INFO = {"trainer_sidecar/gemini_sidecar/metrics.py": "gemini_sidecar_build_info",
               "operator/gemini_operator/runtime/metrics.py": "gemini_operator_build_info",
               "trainer_sidecar/gemini_trainer/launcher_metrics.py": "gemini_launcher_build_info"}
# The operator's per-job series (the others count over every job).
_OPERATOR_PER_JOB = {
    "gemini_operator_replica_coverage_complete_shards", "gemini_operator_replica_coverage_shards",
    "gemini_operator_checkpoint_interval_steps", "gemini_operator_recoverable_step",
    "gemini_operator_replication_lag_steps",
    "gemini_operator_persisted_checkpoint_timestamp_seconds",
    "gemini_operator_persist_interval_seconds",
    "gemini_operator_recovery_started_timestamp_seconds", "gemini_operator_job_state",
}


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


def selectors(expr: str) -> Iterator[tuple[str, dict[str, str]]]:
    """(metric name, {label: matcher as written}) of every selector naming a metric."""
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", expr)
    for match in re.finditer(r"(?<![\w.])([a-zA-Z_:][\w:]*)\b(?!\s*\()(\s*\{([^}]*)\})?",
                             text):
        name, body = match[1], match[3] or ""
        if name.lower() in _KEYWORDS or name == "label_values":
            continue
        matchers = dict(re.findall(r'(\w+)\s*((?:=~|!~|!=|=)\s*"(?:[^"\\]|\\.)*")', body))
        yield name, {k: re.sub(r"\s+", "", v) for k, v in matchers.items()}


def groupings(expr: str) -> list[set[str]]:
    """The label lists of every `by (...)` and `without (...)`."""
    return [{label.strip() for label in m[1].split(",") if label.strip()}
            for m in re.finditer(r"\b(?:by|without)\s*\(([^)]*)\)", expr)]


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


def test_label_extraction_understands_promql():
    expr = ('max by (geminijob_namespace, geminijob) (a_bytes * on (namespace, pod) group_left '
            '(geminijob) b_info{geminijob_namespace=~"$namespace", geminijob=~"$job"})')
    assert list(selectors(expr)) == [
        ("a_bytes", {}),
        ("b_info", {"geminijob_namespace": '=~"$namespace"', "geminijob": '=~"$job"'})]
    assert groupings(expr) == [{"geminijob_namespace", "geminijob"}]


def _per_job(name: str) -> bool:
    family = exported_sample_names().get(name)
    return family is not None and JOB in family.labels


@pytest.mark.parametrize("where, expr", list(queries()))
def test_per_job_series_are_selected_by_the_geminijob_labels(where, expr):
    """Every selector of a per-job series filters on the dashboard's variables by
    geminijob_namespace and geminijob; no gemini_* selector or grouping uses `job` or
    `namespace`, which on a scraped series are the scrape's target labels."""
    variable = where.startswith("variable")
    for name, matchers in selectors(expr):
        if not name.startswith("gemini_"):
            continue
        assert not matchers.keys() & TARGET_LABELS, (
            f"{where}: {name} is selected by a target label ({sorted(matchers)})")
        if _per_job(name) and not variable:
            assert matchers.get(JOB_NAMESPACE) == '=~"$namespace"', f"{where}: {name}"
            assert matchers.get(JOB) == '=~"$job"', f"{where}: {name}"
    for labels in groupings(expr):
        assert not labels & TARGET_LABELS, f"{where}: groups by {sorted(labels)}"


def test_legends_and_variables_name_the_geminijob_labels():
    for panel in panels(DASHBOARD["panels"]):
        for target in panel.get("targets", []):
            legend = target.get("legendFormat", "")
            assert not re.search(r"\{\{\s*(job|namespace)\s*\}\}", legend), (
                f"panel {panel['title']!r}: legend {legend!r}")
    variables = {v["name"]: v["query"]["query"] for v in DASHBOARD["templating"]["list"]
                 if v["type"] == "query"}
    assert variables["namespace"].endswith(f", {JOB_NAMESPACE})")
    assert variables["job"].endswith(f", {JOB})")


def test_the_sidecars_memory_is_shown_against_its_budget():
    exprs = [t["expr"] for p in panels(DASHBOARD["panels"]) for t in p.get("targets", [])
             if p["title"] == "Sidecar resident memory"]
    assert any("process_resident_memory_bytes" in e and "gemini_sidecar_build_info" in e
               for e in exprs)
    assert any("gemini_memory_budget_bytes" in e for e in exprs)


def test_panels_have_unique_ids_titles_and_a_datasource_variable():
    every = list(panels(DASHBOARD["panels"]))
    real = [p for p in every if p["type"] != "row"]
    assert len({p["id"] for p in every}) == len(every)
    assert len({p["title"] for p in real}) == len(real)
    assert all(p["datasource"]["uid"] == "${datasource}" for p in real)
    assert all(p.get("description") for p in real), "every panel says what it shows"


def _project(family: Family) -> bool:
    return not family.standard


@pytest.mark.parametrize("family", [f for f in families() if _project(f)],
                         ids=lambda f: f"{f.module.split('/')[-2]}:{f.name}")
def test_metrics_follow_prometheus_naming(family):
    assert family.name.startswith("gemini_"), "one prefix for every metric of the project"
    assert not re.search(r"_(ms|milliseconds|minutes|hours|kb|mb|gb|kib|mib|gib)(_|$)",
                         family.name), "base units only: seconds and bytes"
    if family.type == "histogram":
        assert re.search(r"_(seconds|bytes)$", family.name), "a histogram names its unit"
    if family.type == "gauge":
        assert not family.name.endswith("_total"), "_total is for counters"
        assert not re.search(r"_age(_|$)|_since(_|$)", family.name), (
            "export when it happened (a _timestamp_seconds gauge), not how long ago")
    labels = family.labels - _BUILD_LABELS if family.name.endswith("_build_info") else (
        family.labels)
    assert not labels & _UNBOUNDED_LABELS, (
        f"labels {sorted(labels & _UNBOUNDED_LABELS)} are unbounded")


@pytest.mark.parametrize("family", list(families()),
                         ids=lambda f: f"{f.module.split('/')[-2]}:{f.name}")
def test_no_metric_exports_a_label_the_scrape_sets(family):
    """Prometheus would rename it exported_<label> (or, honouring it, let a pod forge the
    scrape's own)."""
    assert not family.labels & TARGET_LABELS, sorted(family.labels & TARGET_LABELS)


@pytest.mark.parametrize("family", [f for f in families() if _project(f)],
                         ids=lambda f: f"{f.module.split('/')[-2]}:{f.name}")
def test_per_job_series_name_their_geminijob_namespace_and_rank(family):
    if family.module in _PER_RANK:
        assert family.labels >= {JOB_NAMESPACE, JOB, RANK}, sorted(family.labels)
    elif family.name in _OPERATOR_PER_JOB:
        assert family.labels >= {JOB_NAMESPACE, JOB}, sorted(family.labels)
    else:  # the operator's counts over every job
        assert not family.labels & {JOB_NAMESPACE, JOB, RANK}, sorted(family.labels)


def test_the_operators_per_job_series_are_all_exported():
    exported = {f.name for f in families() if JOB in f.labels
                and f.module == "operator/gemini_operator/runtime/metrics.py"}
    assert exported == _OPERATOR_PER_JOB


@pytest.mark.parametrize("module", sorted(ADAPTERS))
def test_every_component_exports_its_process_and_build(module):
    mine = {f.name: f for f in families() if f.module == module}
    assert {"process_resident_memory_bytes", "process_cpu_seconds", "python_info"} <= set(
        mine), sorted(mine)
    info = mine[_BUILD_INFO[module]]
    assert info.type == "gauge" and info.labels >= _BUILD_LABELS


def test_every_query_expands_as_grafana_sends_it():
    """The e2e case runs each query through tests/fixtures/prometheus.expand: no variable may
    be left for Prometheus to refuse."""
    from tests.fixtures.prometheus import expand

    for where, expr in queries():
        sent = expand(expr, {"namespace": "default", "job": "train"}, "2m")
        assert "$" not in sent, (where, sent)
        assert "[" not in expr or "[2m]" in sent, (where, sent)
