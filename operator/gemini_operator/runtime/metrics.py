"""Prometheus metrics of the operator (served by `gemini operator run --metrics-port`).

A registry of its own, so several operators in one process (tests) do not collide. Per-job
series carry `geminijob_namespace` and `geminijob` (gemini.metric_labels), never `namespace` or
`job`: those are the scrape's own target labels. Only the leader exports per-job series.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    PlatformCollector,
    ProcessCollector,
)

from gemini.domain.recovery import FailureKind
from gemini.metric_labels import JOB, JOB_NAMESPACE, build_labels
from gemini_operator.core.apitime import parse_api_time
from gemini_operator.core.conditions import State
from gemini_operator.core.observed import NodeView, PodView, detection_lags
from gemini_operator.core.records import RECOVERY_SOURCES, RESUME, LastRecovery
from gemini_operator.core.status import CheckpointStatus, ReplicaCoverage

JobKey = tuple[str, str]
PER_JOB = (JOB_NAMESPACE, JOB)


@dataclass(frozen=True)
class JobReport:
    """What one reconcile of a job left, as the per-job series show it."""

    state: State
    checkpoint: CheckpointStatus = field(default_factory=CheckpointStatus)
    recovery_started_unix: float | None = None  # status.recovery.startedUnix, while under way
    persist_interval_seconds: int | None = None  # spec.persistence.intervalSeconds


LISTENERS = ("hints", "metrics", "probes")  # the listeners whose refusals are counted


@dataclass
class OperatorMetrics:
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        r = self.registry
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        self.build_info = Gauge(
            "gemini_operator_build_info", "1, labelled with the running operator's version",
            list(build_labels()), registry=r)
        self.build_info.labels(**build_labels()).set(1)
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
        self.connections_refused = Counter(
            "gemini_operator_connections_refused", "Connections the operator's listeners "
            "closed unanswered, by listener (hints, metrics, probes): over a per-address or "
            "total limit, or no complete request in time", ["listener"], registry=r,
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
        self.persisted_time = Gauge(
            "gemini_operator_persisted_checkpoint_timestamp_seconds",
            "Unix time of a job's newest committed S3 checkpoint (status.checkpoint.persistedTime)",
            PER_JOB, registry=r,
        )
        self.persist_interval = Gauge(
            "gemini_operator_persist_interval_seconds",
            "Seconds between a job's S3 checkpoints (spec.persistence.intervalSeconds); no "
            "series without persistence", PER_JOB, registry=r,
        )
        self.recovery_started = Gauge(
            "gemini_operator_recovery_started_timestamp_seconds",
            "Unix time the job's recovery (or resume) under way started "
            "(status.recovery.startedAt); no series while none is", PER_JOB, registry=r,
        )
        self.job_states = Gauge(
            "gemini_operator_job_state", "1 for each job's status.state (one series per job)",
            [*PER_JOB, "state"], registry=r,
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
            PER_JOB, registry=r,
        )
        self.replica_shards = Gauge(
            "gemini_operator_replica_coverage_shards",
            "Shards of the job whose replicas are counted (one per rank)",
            PER_JOB, registry=r,
        )
        self.checkpoint_interval = Gauge(
            "gemini_operator_checkpoint_interval_steps",
            "Steps between a job's last two snapshots: 1 unless replication lags "
            "(status.checkpoint.effectiveInterval)", PER_JOB, registry=r,
        )
        self.recoverable_step = Gauge(
            "gemini_operator_recoverable_step",
            "Newest step every holder has of every shard (status.checkpoint.recoverableStep)",
            PER_JOB, registry=r,
        )
        self.replication_lag = Gauge(
            "gemini_operator_replication_lag_steps",
            "Steps between a job's newest snapshot and its recoverable step",
            PER_JOB, registry=r,
        )
        self._known_at_zero()
        self._states: dict[tuple[str, str], str] = {}
        # Reconciles of different jobs run in parallel threads: counting the states walks the
        # dict while another job's first (or last) reconcile may add (or remove) its entry.
        self._states_lock = threading.Lock()

    def _known_at_zero(self) -> None:
        """Every recovery counter's known label values from the start, at 0: a series born
        with its first increment shows none in increase() (the dashboard's panels), and a
        missing series is not a 0."""
        for kind in FailureKind:
            self.recoveries.labels(kind=kind.value)
        for cause in (*(kind.value for kind in FailureKind), RESUME):
            for source in RECOVERY_SOURCES:
                self.recoveries_done.labels(cause=cause, source=source)
        for listener in LISTENERS:
            self.connections_refused.labels(listener)

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
                          acted: datetime, parked_at: Mapping[int, datetime] | None = None
                          ) -> None:
        """Count a recovery the operator starts, and how long after the API (or a launcher
        that parked the failed epoch) showed each cause of its (rank, cause) `failures` it
        acted."""
        self.recoveries.labels(kind=kind).inc()
        self.detections.inc()
        for cause, lag in detection_lags(failures, pods, nodes, acted, parked_at).items():
            self.detection_seconds.labels(cause=cause).observe(lag)

    def reconciled(self, key: JobKey, report: JobReport, seconds: float) -> None:
        """Export what a reconcile of job `key` left, and how long it took."""
        self.job_state(key, report.state)
        self.replica_coverage(key, report.checkpoint.replica_coverage)
        self.checkpoint_pace(key, report.checkpoint)
        persisted = parse_api_time(report.checkpoint.persisted_time)
        _export(self.persisted_time, key, None if persisted is None else persisted.timestamp())
        _export(self.persist_interval, key, report.persist_interval_seconds)
        _export(self.recovery_started, key, report.recovery_started_unix)
        self.reconcile_seconds.observe(seconds)

    def forget(self, key: JobKey) -> None:
        """Job `key` is gone: its series go."""
        self.job_state(key, None)
        self.replica_coverage(key, None)
        self.checkpoint_pace(key, None)
        for gauge in (self.persisted_time, self.persist_interval, self.recovery_started):
            _export(gauge, key, None)

    def forget_all(self) -> None:
        """This replica no longer leads: the new leader exports the jobs, not a stale copy."""
        with self._states_lock:
            keys = list(self._states)
        for key in keys:
            self.forget(key)

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
        """Record a job's state (None: the job is gone) and refresh the per-state gauges."""
        with self._states_lock:
            before = self._states.get(key)
            if state is None:
                self._states.pop(key, None)
            else:
                self._states[key] = state.value
            if before is not None and before != self._states.get(key):
                with contextlib.suppress(KeyError):
                    self.job_states.remove(*key, before)
            if state is not None:
                self.job_states.labels(*key, state.value).set(1)
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
        gauge.labels(*key).set(value)
