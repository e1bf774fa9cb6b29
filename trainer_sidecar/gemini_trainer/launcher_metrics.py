"""Prometheus metrics of one launcher, read from its status at scrape time; every gemini_*
series is labelled with its GeminiJob (`geminijob_namespace`, `geminijob`) and `rank`, as the
sidecar's, never with a scrape's own target labels (gemini.metric_labels: Prometheus adds
`namespace`, `pod`, `job` itself). The process collectors' series carry none of ours.

A collector rather than counters kept beside the state: the status is the one source of truth,
so a scrape can never disagree with GET /status.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from gemini.metric_labels import JOB, JOB_NAMESPACE, RANK, build_labels, namespace_from_env

StatusSource = Callable[[], Mapping[str, Any]]


LABELS = (JOB_NAMESPACE, JOB, RANK)


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
        "gemini_launcher_heartbeat_timestamp_seconds": (
            "Unix time of the last heartbeat (NaN: none)", _or_nan(progress.get("unix"))),
    }


class LauncherCollector(Collector):
    def __init__(self, status: StatusSource, namespace: str, job: str, rank: str) -> None:
        self._status = status
        self._labels = [namespace, job, rank]
        self._build = build_labels()  # the installed package's metadata: read once

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        s = self._status()
        build = self._build
        info = GaugeMetricFamily("gemini_launcher_build_info",
                                 "1, labelled with the running launcher's version",
                                 labels=[*LABELS, *build])
        info.add_metric([*self._labels, *build.values()], 1)
        yield info
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


def job_labels(env: Mapping[str, str]) -> tuple[str, str, str]:
    """(namespace, job, rank) of the launcher's series, from the environment the operator
    sets. A job without GEMINI_NAMESPACE (started by hand) is in "default", said in a
    warning, as the sidecar does; a launcher of no job (a local run) names none."""
    job = env.get("GEMINI_JOB", "")
    namespace = namespace_from_env(env, "the metrics' geminijob_namespace label") if job else ""
    return namespace, job, env.get("GEMINI_RANK") or env.get("RANK", "")


def make_registry(status: StatusSource, namespace: str = "", job: str = "",
                  rank: str = "") -> CollectorRegistry:
    """The launcher's registry: its status of GeminiJob `namespace`/`job`, rank `rank`, and
    its process."""
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    registry.register(LauncherCollector(status, namespace, job, rank))
    return registry


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
