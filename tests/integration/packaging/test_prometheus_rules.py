"""The chart's PrometheusRule, rendered by the real helm, through the real promtool: the rules
load (`promtool check rules`), and each alert fires when its condition has held for its `for`,
and not otherwise (`promtool test rules`, input series as the chart's monitors scrape them).

promtool comes from gemini_local.monitoring (built from Go modules by
hack/build-monitoring.sh); GEMINI_PROMTOOL names another one.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.fixtures.helm import Helm, one

pytestmark = pytest.mark.integration

MONITORING = "monitoring.coreos.com/v1"
SERVICE = "gemini-gemini-operator-metrics"  # the metrics Service of release "gemini"
# The operator's series as its ServiceMonitor scrapes them (the Prometheus Operator's target
# labels), and a sidecar's as the PodMonitor does.
OPERATOR = {"job": SERVICE, "namespace": "gemini-system", "pod": "gemini-gemini-operator-0",
            "instance": "10.0.0.1:9090", "container": "operator", "endpoint": "metrics"}
SIDECAR = {"job": "gemini-system/gemini-gemini-operator-workers", "namespace": "ml",
           "instance": "10.0.1.1:7071", "container": "gemini-sidecar", "endpoint": "sidecar-api"}
SUMMARIES = ("summary", "description")


@pytest.fixture(scope="session")
def promtool() -> Path:
    given = os.environ.get("GEMINI_PROMTOOL")
    if given:
        return Path(given)
    from gemini_local import monitoring  # lazily: collecting must not build Prometheus

    return monitoring.promtool()


@pytest.fixture(scope="module")
def rule_spec(helm: Helm) -> dict[str, Any]:
    """The `spec` of the PrometheusRule the chart renders with every alert on."""
    objects = helm.template(
        "--set", "prometheusRule.enabled=true,serviceMonitor.enabled=true",
        "--api-versions", f"{MONITORING}/PrometheusRule",
        "--api-versions", f"{MONITORING}/ServiceMonitor")
    spec: dict[str, Any] = one(objects, "PrometheusRule")["spec"]
    return spec


def run(promtool: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(promtool), *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120, check=False)


def series(name: str, labels: Mapping[str, str], values: str) -> dict[str, str]:
    body = ", ".join(f'{k}="{v}"' for k, v in labels.items())
    return {"series": f"{name}{{{body}}}", "values": values}


def job(name: str, **more: str) -> dict[str, str]:
    return {"geminijob_namespace": "ml", "geminijob": name, **more}


def op(name: str, **more: str) -> dict[str, str]:
    """An operator per-job series' labels."""
    return {**OPERATOR, **job(name), **more}


def sidecar(name: str, rank: int) -> dict[str, str]:
    return {**SIDECAR, **job(name), "rank": str(rank), "pod": f"{name}-worker-{rank}"}


def state(name: str, value: str) -> dict[str, str]:
    return series("gemini_operator_job_state", op(name, state=value), "1x60")


def firing(alert: str, labels: Mapping[str, str], severity: str,
           annotations: Mapping[str, str] | None = None) -> dict[str, Any]:
    runbook = {"runbook_url": f"docs/troubleshooting.md#{alert.lower()}"}
    return {"exp_labels": {**labels, "severity": severity},
            "exp_annotations": {**runbook, **(annotations or {})}}


def check(alert: str, *evaluations: tuple[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """alert_rule_test entries: at each time, exactly these alerts firing."""
    return [{"eval_time": at, "alertname": alert, "exp_alerts": alerts}
            for at, alerts in evaluations]


def group(name: str, inputs: list[dict[str, str]], tests: list[dict[str, Any]]
          ) -> dict[str, Any]:
    return {"name": name, "interval": "1m", "input_series": inputs, "alert_rule_test": tests}


def label_tests() -> list[dict[str, Any]]:
    """Every alert: its condition held for its `for` fires it (labels and runbook compared);
    a condition that does not hold, or not long enough, or in another state, does not."""
    groups = []
    # A shard short of a copy, or no recoverable step, on a Running job, for 10 minutes.
    groups.append(group("not recoverable from memory", [
        series("gemini_operator_replica_coverage_complete_shards", op("short"), "3x60"),
        series("gemini_operator_replica_coverage_shards", op("short"), "4x60"),
        series("gemini_operator_recoverable_step", op("short"), "7x60"),
        state("short", "Running"),
        series("gemini_operator_replica_coverage_complete_shards", op("norec"), "4x60"),
        series("gemini_operator_replica_coverage_shards", op("norec"), "4x60"),
        state("norec", "Running"),
        series("gemini_operator_replica_coverage_complete_shards", op("full"), "4x60"),
        series("gemini_operator_replica_coverage_shards", op("full"), "4x60"),
        series("gemini_operator_recoverable_step", op("full"), "7x60"),
        state("full", "Running"),
        series("gemini_operator_replica_coverage_complete_shards", op("parked"), "1x60"),
        series("gemini_operator_replica_coverage_shards", op("parked"), "4x60"),
        series("gemini_operator_recoverable_step", op("parked"), "7x60"),
        state("parked", "Suspended"),
        # short for 5 minutes only, then whole again
        series("gemini_operator_replica_coverage_complete_shards", op("blip"), "3x5 4x55"),
        series("gemini_operator_replica_coverage_shards", op("blip"), "4x60"),
        series("gemini_operator_recoverable_step", op("blip"), "7x60"),
        state("blip", "Running"),
    ], check("GeminiJobNotRecoverableFromMemory",
             ("9m", []),
             ("15m", [firing("GeminiJobNotRecoverableFromMemory", op("short"), "critical"),
                      firing("GeminiJobNotRecoverableFromMemory", op("norec"), "critical")]))))
    # Recovering since Unix time 0 (promtool's clock starts there): over 600 s from 10m on,
    # firing a minute later; one that started at 300 s is not over yet at 13m.
    groups.append(group("recovery too long", [
        series("gemini_operator_recovery_started_timestamp_seconds", op("slow"), "0x60"),
        state("slow", "Recovering"),
        series("gemini_operator_recovery_started_timestamp_seconds", op("quick"), "300x60"),
        state("quick", "Recovering"),
        series("gemini_operator_recovery_started_timestamp_seconds", op("done"), "0x60"),
        state("done", "Running"),
    ], check("GeminiJobRecoveryTooLong",
             ("10m", []),
             ("13m", [firing("GeminiJobRecoveryTooLong", op("slow"), "critical")]))))
    # A 5-minute interval: older than 10 minutes from 10m on, firing 15 minutes later.
    groups.append(group("S3 persistence stale", [
        series("gemini_operator_persisted_checkpoint_timestamp_seconds", op("stale"), "0x60"),
        series("gemini_operator_persist_interval_seconds", op("stale"), "300x60"),
        state("stale", "Running"),
        series("gemini_operator_persisted_checkpoint_timestamp_seconds", op("fresh"),
               "0+60x60"),
        series("gemini_operator_persist_interval_seconds", op("fresh"), "300x60"),
        state("fresh", "Running"),
        series("gemini_operator_persisted_checkpoint_timestamp_seconds", op("parked"), "0x60"),
        series("gemini_operator_persist_interval_seconds", op("parked"), "300x60"),
        state("parked", "Suspended"),
        series("gemini_operator_persisted_checkpoint_timestamp_seconds", op("none"), "0x60"),
        state("none", "Running"),  # no persistence: no interval series
    ], check("GeminiJobS3PersistenceStale",
             ("20m", []),
             ("30m", [firing("GeminiJobS3PersistenceStale", op("stale"), "warning")]))))
    # A failure a minute on two ranks, one sum per job; one failure only; none.
    groups.append(group("S3 persistence failing", [
        series("gemini_s3_failures_total", sidecar("failing", 0), "0+1x60"),
        series("gemini_s3_failures_total", sidecar("failing", 1), "0+1x60"),
        series("gemini_s3_failures_total", sidecar("once", 0), "0x2 1x57"),
        series("gemini_s3_failures_total", sidecar("fine", 0), "0x60"),
    ], check("GeminiJobS3PersistenceFailing",
             ("10m", []),
             ("20m", [firing("GeminiJobS3PersistenceFailing", job("failing"), "warning")]))))
    groups.append(group("sidecar memory near budget", [
        series("gemini_memory_used_bytes", sidecar("train", 0), "95x60"),
        series("gemini_memory_budget_bytes", sidecar("train", 0), "100x60"),
        series("gemini_memory_used_bytes", sidecar("train", 1), "80x60"),
        series("gemini_memory_budget_bytes", sidecar("train", 1), "100x60"),
        series("gemini_memory_used_bytes", sidecar("train", 2), "5x60"),
        series("gemini_memory_budget_bytes", sidecar("train", 2), "0x60"),
    ], check("GeminiSidecarMemoryNearBudget",
             ("10m", []),
             ("20m", [firing("GeminiSidecarMemoryNearBudget", sidecar("train", 0),
                             "warning")]))))
    groups.append(group("replication lagging", [
        series("gemini_operator_replication_lag_steps", op("lagging"), "30x60"),
        state("lagging", "Running"),
        series("gemini_operator_replication_lag_steps", op("keeping-up"), "5x60"),
        state("keeping-up", "Running"),
        series("gemini_operator_replication_lag_steps", op("blip"), "30x5 5x55"),
        state("blip", "Running"),
        series("gemini_operator_replication_lag_steps", op("parked"), "30x60"),
        state("parked", "Suspended"),
    ], check("GeminiJobReplicationLagging",
             ("9m", []),
             ("15m", [firing("GeminiJobReplicationLagging", op("lagging"), "warning")]))))
    scrape = {"job": SERVICE, "namespace": "gemini-system"}
    # Up for 10 minutes, then down: firing 5 minutes later.
    groups.append(group("operator down", [
        series("up", OPERATOR, "1x10 0x50"),
    ], check("GeminiOperatorDown",
             ("14m", []),
             ("20m", [firing("GeminiOperatorDown", scrape, "critical")]))))
    groups.append(group("operator never scraped", [
        series("up", {**OPERATOR, "job": "something-else"}, "1x60"),
    ], check("GeminiOperatorDown",
             ("4m", []),
             ("10m", [firing("GeminiOperatorDown", scrape, "critical")]))))
    groups.append(group("one operator replica of two down", [
        series("up", OPERATOR, "0x60"),
        series("up", {**OPERATOR, "pod": "gemini-gemini-operator-1"}, "1x60"),
    ], check("GeminiOperatorDown", ("20m", []))))
    groups.append(group("reconciles keep failing", [
        series("gemini_operator_reconcile_errors_total", OPERATOR, "0+2x60"),
    ], check("GeminiOperatorReconcileErrors",
             ("10m", []),
             ("20m", [firing("GeminiOperatorReconcileErrors", scrape, "warning")]))))
    groups.append(group("one failed reconcile", [
        series("gemini_operator_reconcile_errors_total", OPERATOR, "0x2 1x57"),
    ], check("GeminiOperatorReconcileErrors", ("10m", []), ("20m", []))))
    return groups


def annotation_tests() -> list[dict[str, Any]]:
    """The annotations' templates expand as written (humanizeDuration, humanizePercentage)."""
    slow = "ml/slow"
    return [
        group("recovery too long, annotated", [
            series("gemini_operator_recovery_started_timestamp_seconds", op("slow"), "0x60"),
            state("slow", "Recovering"),
        ], check("GeminiJobRecoveryTooLong", ("13m", [firing(
            "GeminiJobRecoveryTooLong", op("slow"), "critical", {
                "summary": f"GeminiJob {slow} has been recovering for too long",
                "description": f"{slow} started recovering 13m 0s ago (more than 600 s): "
                               "training is stopped until it finishes."})]))),
        group("sidecar memory, annotated", [
            series("gemini_memory_used_bytes", sidecar("train", 0), "95x60"),
            series("gemini_memory_budget_bytes", sidecar("train", 0), "100x60"),
        ], check("GeminiSidecarMemoryNearBudget", ("20m", [firing(
            "GeminiSidecarMemoryNearBudget", sidecar("train", 0), "warning", {
                "summary": "A sidecar of GeminiJob ml/train is near its memory budget",
                "description": "The replica store of rank 0 of ml/train uses 95% of its memory "
                               "budget (the threshold: 0.9): a larger version, or another rank "
                               "to hold, will be refused."})]))),
    ]


def write_rules(spec: Mapping[str, Any], path: Path, keep: tuple[str, ...] = SUMMARIES) -> None:
    """The rule's groups as a Prometheus rules file; annotations other than `keep` and the
    runbook left out (the label tests compare the runbook only)."""
    groups = [{**g, "rules": [{**r, "annotations": {
        k: v for k, v in r["annotations"].items() if k in (*keep, "runbook_url")}}
        for r in g["rules"]]} for g in spec["groups"]]
    path.write_text(yaml.safe_dump({"groups": groups}, sort_keys=False))


def write_tests(path: Path, rules: str, groups: list[dict[str, Any]]) -> None:
    path.write_text(yaml.safe_dump({"rule_files": [rules], "evaluation_interval": "1m",
                                    "tests": groups}, sort_keys=False))


def test_the_rules_load(promtool: Path, rule_spec: dict[str, Any], tmp_path: Path) -> None:
    write_rules(rule_spec, tmp_path / "rules.yaml")
    result = run(promtool, "check", "rules", "rules.yaml", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 8 rules found" in result.stdout + result.stderr


def test_every_alert_fires_on_its_condition_and_not_otherwise(
        promtool: Path, rule_spec: dict[str, Any], tmp_path: Path) -> None:
    alerts = {r["alert"] for g in rule_spec["groups"] for r in g["rules"]}
    groups = label_tests()
    assert {t["alertname"] for g in groups for t in g["alert_rule_test"]} == alerts
    write_rules(rule_spec, tmp_path / "rules.yaml", keep=())
    write_tests(tmp_path / "tests.yaml", "rules.yaml", groups)
    result = run(promtool, "test", "rules", "tests.yaml", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_annotations_expand(promtool: Path, rule_spec: dict[str, Any],
                                tmp_path: Path) -> None:
    write_rules(rule_spec, tmp_path / "rules.yaml")
    write_tests(tmp_path / "tests.yaml", "rules.yaml", annotation_tests())
    result = run(promtool, "test", "rules", "tests.yaml", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_test_that_should_fail_fails(promtool: Path, rule_spec: dict[str, Any],
                                       tmp_path: Path) -> None:
    """The harness can see a wrong expectation: a job whose coverage is whole does not
    fire, so expecting it to fails."""
    write_rules(rule_spec, tmp_path / "rules.yaml", keep=())
    wrong = group("whole coverage", [
        series("gemini_operator_replica_coverage_complete_shards", op("full"), "4x60"),
        series("gemini_operator_replica_coverage_shards", op("full"), "4x60"),
        series("gemini_operator_recoverable_step", op("full"), "7x60"),
        state("full", "Running"),
    ], check("GeminiJobNotRecoverableFromMemory", ("15m", [
        firing("GeminiJobNotRecoverableFromMemory", op("full"), "critical")])))
    write_tests(tmp_path / "tests.yaml", "rules.yaml", [wrong])
    assert run(promtool, "test", "rules", "tests.yaml", cwd=tmp_path).returncode != 0
