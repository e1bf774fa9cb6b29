"""The launcher's Prometheus metrics follow its status at scrape time."""

from __future__ import annotations

import math
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from gemini_trainer.launcher_metrics import make_registry, render, start_seconds


def _samples(status: dict[str, Any]) -> dict[str, float]:
    text = render(make_registry(lambda: status, "train", "1")).decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not sample.name.endswith("_created"):
                assert sample.labels == {"job": "train", "rank": "1"}
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
    assert got["gemini_launcher_heartbeat_age_seconds"] == 0.25


def test_before_any_heartbeat_or_exit_the_unknowns_are_nan() -> None:
    got = _samples({"state": "held", "epoch": 0, "restarts": 0, "exit_code": None,
                    "warm": False, "started_at": None, "progress": None})
    assert got["gemini_launcher_training_running"] == 0
    assert got["gemini_launcher_standby_ready"] == 0
    for name in ("last_exit_code", "start_seconds", "progress_step", "heartbeat_age_seconds"):
        assert math.isnan(got[f"gemini_launcher_{name}"]), name


def test_a_heartbeat_left_from_the_previous_process_is_not_its_start_up() -> None:
    assert math.isnan(start_seconds({"started_at": 50.0, "progress": {"unix": 49.0}}))
