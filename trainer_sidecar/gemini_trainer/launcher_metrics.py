"""Prometheus metrics of one launcher, read from its status at scrape time; labels job and
rank only, as the sidecar's (Prometheus adds the namespace and pod target labels).

A collector rather than counters kept beside the state: the status is the one source of truth,
so a scrape can never disagree with GET /status.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

StatusSource = Callable[[], Mapping[str, Any]]


LABELS = ("job", "rank")


def start_seconds(status: Mapping[str, Any]) -> float:
    """Seconds from the current training process's start to its first heartbeat of this run
    (NaN until it beats): the restart cost a recovery pays on this rank."""
    started, progress = status.get("started_at"), status.get("progress") or {}
    beat = progress.get("unix")
    if started is None or beat is None or beat < started:
        return math.nan
    return float(beat) - float(started)


def _or_nan(value: Any) -> float:
    return math.nan if value is None else float(value)


def gauge_values(s: Mapping[str, Any]) -> dict[str, tuple[str, float]]:
    """Gauge name -> (help, value) from one launcher status."""
    progress = s.get("progress") or {}
    return {
        "gemini_launcher_epoch": ("restart epoch the training process runs",
                                  int(s.get("epoch") or 0)),
        "gemini_launcher_training_running": ("1 while the training process runs",
                                             int(s.get("state") == "running")),
        "gemini_launcher_training_parked": (
            "1 while the training process failed and waits for an in-process restart",
            int(s.get("state") == "parked")),
        "gemini_launcher_last_exit_code": (
            "exit code of the last training process (NaN: none exited)",
            _or_nan(s.get("exit_code"))),
        "gemini_launcher_warm_start": (
            "1 if the current training process started from the warm standby",
            int(bool(s.get("warm")))),
        "gemini_launcher_standby_ready": (
            "1 while a warm standby has done its imports and waits for the next restart",
            int(bool((s.get("standby") or {}).get("ready")))),
        "gemini_launcher_start_seconds": (
            "seconds from the current process's start to its first heartbeat",
            start_seconds(s)),
        "gemini_launcher_progress_step": ("step of the last heartbeat (NaN: none)",
                                          _or_nan(progress.get("step"))),
        "gemini_launcher_heartbeat_age_seconds": ("seconds since the last heartbeat (NaN: none)",
                                                  _or_nan(progress.get("age_s"))),
    }


class LauncherCollector(Collector):
    def __init__(self, status: StatusSource, job: str, rank: str) -> None:
        self._status = status
        self._labels = [job, rank]

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        s = self._status()
        restarts = CounterMetricFamily(
            "gemini_launcher_restarts", "training process starts requested through /restart",
            labels=LABELS)
        restarts.add_metric(self._labels, int(s.get("restarts") or 0))
        yield restarts
        in_process = CounterMetricFamily(
            "gemini_launcher_in_process_restarts",
            "restarts a parked training process took in place (no new process)", labels=LABELS)
        in_process.add_metric(self._labels, int(s.get("in_process") or 0))
        yield in_process
        for name, (doc, value) in gauge_values(s).items():
            family = GaugeMetricFamily(name, doc, labels=LABELS)
            family.add_metric(self._labels, value)
            yield family


def make_registry(status: StatusSource, job: str = "", rank: str = "") -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(LauncherCollector(status, job, rank))
    return registry


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
