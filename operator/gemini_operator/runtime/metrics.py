"""Prometheus metrics of the operator (served by `gemini operator run --metrics-port`).

A registry of its own, so several operators in one process (tests) do not collide.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from gemini_operator.core.apitime import parse_api_time
from gemini_operator.core.conditions import State
from gemini_operator.core.observed import NodeView, PodView, detection_lags
from gemini_operator.core.records import LastRecovery
from gemini_operator.core.status import CheckpointStatus, ReplicaCoverage

JobKey = tuple[str, str]


@dataclass
class OperatorMetrics:
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        r = self.registry
        self.reconciles = Counter("gemini_operator_reconciles", "Reconciles run", registry=r)
        self.reconcile_errors = Counter(
            "gemini_operator_reconcile_errors", "Reconciles that failed and will be retried",
            registry=r,
        )
        self.reconcile_seconds = Histogram(
            "gemini_operator_reconcile_seconds", "Duration of one reconcile", registry=r,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
        )
        self.poll_seconds = Histogram(
            "gemini_operator_poll_seconds", "Duration of one job's poll of its workers "
            "(inventories, and persisting when due)", registry=r,
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16),
        )
        self.hints = Counter(
            "gemini_operator_failure_hints", "Failure hints from launchers, by result "
            "(polled, throttled, unauthorized, unknown, malformed, not-leader)", ["result"],
            registry=r,
        )
        self.status_writes = Counter(
            "gemini_operator_status_writes", "Status subresource writes", registry=r
        )
        self.jobs = Gauge("gemini_operator_jobs", "GeminiJobs by state", ["state"], registry=r)
        self.recoveries = Counter(
            "gemini_operator_recoveries", "Recoveries decided, by failure kind", ["kind"],
            registry=r,
        )
        self.leader = Gauge("gemini_operator_leader", "1 while this replica leads", registry=r)
        self.detections = Counter(
            "gemini_operator_failures_detected", "Failures that started a recovery", registry=r
        )
        self.recoveries_done = Counter(
            "gemini_operator_recoveries_finished", "Recoveries finished, by cause and source",
            ["cause", "source"], registry=r,
        )
        self.recovery_seconds = Histogram(
            "gemini_operator_recovery_seconds", "From detection to every launcher restarted",
            registry=r, buckets=(0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300),
        )
        self.recovery_phase_seconds = Histogram(
            "gemini_operator_recovery_phase_seconds", "Seconds per recovery phase", ["phase"],
            registry=r, buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60),
        )
        self.downtime = Counter(
            "gemini_operator_recovery_downtime_seconds",
            "Seconds between detection and every launcher running the new epoch, summed",
            registry=r,
        )
        self.persist_age = Gauge(
            "gemini_operator_persisted_checkpoint_age_seconds",
            "Seconds since the newest committed S3 checkpoint of a job", ["job"], registry=r,
        )
        self.steps_lost = Counter(
            "gemini_operator_steps_lost", "Training steps redone after recoveries", registry=r
        )
        self.detection_seconds = Histogram(
            "gemini_operator_failure_detection_seconds",
            "From a failure becoming visible in the API (trainer finishedAt, node Ready "
            "transition, pod disruption or deletion request; second precision) to the "
            "operator deciding the recovery, by failure reason", ["cause"], registry=r,
            buckets=(0.25, 0.5, 1, 2, 3, 5, 10, 20, 30, 60, 120),
        )
        self.replicas_complete = Gauge(
            "gemini_operator_replica_coverage_complete_shards",
            "Shards with all m in-memory copies complete (status.checkpoint.replicaCoverage)",
            ["namespace", "job"], registry=r,
        )
        self.replica_shards = Gauge(
            "gemini_operator_replica_coverage_shards",
            "Shards of the job whose replicas are counted (one per rank)",
            ["namespace", "job"], registry=r,
        )
        self.checkpoint_interval = Gauge(
            "gemini_operator_checkpoint_interval_steps",
            "Steps between a job's last two snapshots: 1 unless replication lags "
            "(status.checkpoint.effectiveInterval)", ["namespace", "job"], registry=r,
        )
        self.recoverable_step = Gauge(
            "gemini_operator_recoverable_step",
            "Newest step every holder has of every shard (status.checkpoint.recoverableStep)",
            ["namespace", "job"], registry=r,
        )
        self.replication_lag = Gauge(
            "gemini_operator_replication_lag_steps",
            "Steps between a job's newest snapshot and its recoverable step",
            ["namespace", "job"], registry=r,
        )
        self._states: dict[tuple[str, str], str] = {}
        # Reconciles of different jobs run in parallel threads: counting the states walks the
        # dict while another job's first (or last) reconcile may add (or remove) its entry.
        self._states_lock = threading.Lock()

    def observe_recovery(self, last: LastRecovery) -> None:
        """Count a finished recovery (status.lastRecovery)."""
        self.recoveries_done.labels(cause=last.cause, source=last.source).inc()
        self.recovery_seconds.observe(last.duration_seconds)
        self.steps_lost.inc(last.steps_lost)
        self.downtime.inc(last.duration_seconds)
        for phase, seconds in last.breakdown.items():
            self.recovery_phase_seconds.labels(phase=phase).observe(seconds)

    def recovery_detected(self, kind: str, failures: Iterable[tuple[int, str]],
                          pods: Mapping[int, PodView], nodes: Mapping[str, NodeView],
                          acted: datetime) -> None:
        """Count a recovery the operator starts, and how long after the API showed each
        cause of its (rank, cause) `failures` it acted."""
        self.recoveries.labels(kind=kind).inc()
        self.detections.inc()
        for cause, lag in detection_lags(failures, pods, nodes, acted).items():
            self.detection_seconds.labels(cause=cause).observe(lag)

    def reconciled(self, key: JobKey, state: State, checkpoint: CheckpointStatus,
                   clock: Callable[[], datetime], seconds: float) -> None:
        """Export what a reconcile of job `key` left, and how long it took."""
        self.job_state(key, state)
        self.replica_coverage(key, checkpoint.replica_coverage)
        self.checkpoint_pace(key, checkpoint)
        persisted = parse_api_time(checkpoint.persisted_time)
        if persisted is not None:
            age = (clock() - persisted).total_seconds()
            self.persist_age.labels(job=f"{key[0]}/{key[1]}").set(age)
        self.reconcile_seconds.observe(seconds)

    def forget(self, key: JobKey) -> None:
        """Job `key` is gone: its series go."""
        self.job_state(key, None)
        self.replica_coverage(key, None)
        self.checkpoint_pace(key, None)

    def replica_coverage(self, key: JobKey, coverage: ReplicaCoverage | None) -> None:
        """Export a job's replica coverage; None (the job is gone, or nothing is known yet)
        removes its series."""
        _export(self.replicas_complete, key, None if coverage is None else coverage.complete)
        _export(self.replica_shards, key, None if coverage is None else coverage.total)

    def checkpoint_pace(self, key: JobKey, checkpoint: CheckpointStatus | None) -> None:
        """Export a job's replication pace; None (the job is gone) removes its series, and a
        value not known yet is not exported."""
        known = checkpoint or CheckpointStatus()
        _export(self.checkpoint_interval, key, known.effective_interval)
        _export(self.recoverable_step, key, known.recoverable_step)
        _export(self.replication_lag, key, known.replication_lag_steps)

    def job_state(self, key: tuple[str, str], state: State | None) -> None:
        """Record a job's state (None: the job is gone) and refresh the per-state gauge."""
        with self._states_lock:
            if state is None:
                self._states.pop(key, None)
            else:
                self._states[key] = state.value
            for each in State:
                self.jobs.labels(state=each.value).set(
                    sum(1 for s in self._states.values() if s == each.value)
                )


def _export(gauge: Gauge, key: JobKey, value: float | None) -> None:
    """A job's value, or no series at all while it is unknown (None)."""
    if value is None:
        with contextlib.suppress(KeyError):  # never exported
            gauge.remove(*key)
    else:
        gauge.labels(namespace=key[0], job=key[1]).set(value)
