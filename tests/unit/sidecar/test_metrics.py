"""The sidecar's Prometheus series: every gemini_* one names its GeminiJob (namespace from the
environment the operator renders) and rank, never a scrape's own target label; its process
and build are exported too."""

from __future__ import annotations

import logging
import platform

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gemini import metric_labels
from gemini_sidecar.config import from_env
from gemini_sidecar.metrics import make_metrics
from tests.unit.sidecar.test_config import BASE

JOB = {"geminijob_namespace": "team-a", "geminijob": "j1", "rank": "2"}


def _samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    return [(s.name, dict(s.labels), s.value) for f in text_string_to_metric_families(text)
            for s in f.samples]


def test_every_series_names_its_job_and_rank_and_no_target_label() -> None:
    metrics = make_metrics("team-a", "j1", 2)
    metrics.replication_bytes.inc(5)
    metrics.memory_used.set(10)
    samples = _samples(metrics.render().decode())
    ours = [(n, labels) for n, labels, _ in samples if n.startswith("gemini_")]
    assert len(ours) > 20
    for name, labels in ours:
        assert labels.items() >= JOB.items(), name
    for name, labels, _ in samples:
        assert not labels.keys() & metric_labels.TARGET_LABELS, name
    values = {n: v for n, labels, v in samples}
    assert values["gemini_replication_bytes_total"] == 5
    assert values["process_resident_memory_bytes"] > 0


def test_the_build_is_exported() -> None:
    metrics = make_metrics("team-a", "j1", 2)
    labels = {**JOB, "version": metric_labels.version(),
              "python_version": platform.python_version()}
    assert metrics.registry.get_sample_value("gemini_sidecar_build_info", labels) == 1


def test_the_namespace_is_the_rendered_one_or_default_with_a_warning(
        caplog: pytest.LogCaptureFixture) -> None:
    assert from_env(dict(BASE, GEMINI_NAMESPACE="team-a")).namespace == "team-a"
    with caplog.at_level(logging.WARNING):
        assert from_env(dict(BASE)).namespace == metric_labels.DEFAULT_NAMESPACE
    assert "GEMINI_NAMESPACE is not set" in caplog.text
