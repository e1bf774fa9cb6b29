"""The launcher's Prometheus metrics follow its status at scrape time, labelled with the
GeminiJob and rank (never with a scrape's own target labels)."""

from __future__ import annotations

import math
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from gemini_trainer.launcher_metrics import job_labels, make_registry, render, start_seconds

LABELS = {"geminijob_namespace": "team", "geminijob": "train", "rank": "1"}


def _samples(status: dict[str, Any]) -> dict[str, float]:
    text = render(make_registry(lambda: status, "team", "train", "1")).decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "gemini_launcher_build_info":
                assert sample.labels.items() >= LABELS.items()
            elif sample.name.startswith("gemini_") and not sample.name.endswith("_created"):
                assert sample.labels == LABELS
            out[sample.name] = sample.value
    return out


def test_a_running_restarted_process_is_reported_with_its_start_up_time() -> None:
    got = _samples({"state": "running", "epoch": 3, "restarts": 2, "exit_code": 1,
                    "warm": True, "started_at": 100.0, "standby": {"pid": 9, "ready": True},
                    "progress": {"step": 7, "unix": 104.5, "age_s": 0.25}})
    assert got["gemini_launcher_restarts_total"] == 2
    assert got["gemini_launcher_epoch"] == 3
    assert got["gemini_launcher_training_running"] == 1
    assert got["gemini_launcher_last_exit_code"] == 1
    assert got["gemini_launcher_warm_start"] == 1
    assert got["gemini_launcher_standby_ready"] == 1
    assert got["gemini_launcher_start_seconds"] == 4.5
    assert got["gemini_launcher_progress_step"] == 7
    assert got["gemini_launcher_heartbeat_timestamp_seconds"] == 104.5


def test_before_any_heartbeat_or_exit_the_unknowns_are_nan() -> None:
    got = _samples({"state": "held", "epoch": 0, "restarts": 0, "exit_code": None,
                    "warm": False, "started_at": None, "progress": None})
    assert got["gemini_launcher_training_running"] == 0
    assert got["gemini_launcher_standby_ready"] == 0
    for name in ("last_exit_code", "start_seconds", "progress_step",
                 "heartbeat_timestamp_seconds"):
        assert math.isnan(got[f"gemini_launcher_{name}"]), name


def test_a_heartbeat_left_from_the_previous_process_is_not_its_start_up() -> None:
    assert math.isnan(start_seconds({"started_at": 50.0, "progress": {"unix": 49.0}}))


def test_the_process_and_the_build_are_exported() -> None:
    got = _samples({"state": "held"})
    assert got["gemini_launcher_build_info"] == 1
    assert got["process_resident_memory_bytes"] > 0
    assert got["python_info"] == 1
    text = render(make_registry(lambda: {}, "team", "train", "1")).decode()
    info = next(s for f in text_string_to_metric_families(text) for s in f.samples
                if s.name == "gemini_launcher_build_info")
    assert set(info.labels) == {*LABELS, "version", "python_version"}


def test_the_job_comes_from_the_environment_the_operator_sets(caplog) -> None:
    env = {"GEMINI_NAMESPACE": "team", "GEMINI_JOB": "train", "GEMINI_RANK": "1"}
    assert job_labels(env) == ("team", "train", "1")
    assert job_labels({"GEMINI_JOB": "train", "RANK": "2"}) == ("default", "train", "2")
    assert "GEMINI_NAMESPACE is not set" in caplog.text
    assert job_labels({}) == ("", "", "")  # a local run of no job
