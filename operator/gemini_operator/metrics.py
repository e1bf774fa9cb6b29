"""Prometheus metrics of the operator (served by `gemini operator run --metrics-port`).

A registry of its own, so several operators in one process (tests) do not collide.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from gemini_operator.conditions import State


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
        self.status_writes = Counter(
            "gemini_operator_status_writes", "Status subresource writes", registry=r
        )
        self.jobs = Gauge("gemini_operator_jobs", "GeminiJobs by state", ["state"], registry=r)
        self.recoveries = Counter(
            "gemini_operator_recoveries", "Recoveries decided, by failure kind", ["kind"],
            registry=r,
        )
        self.leader = Gauge("gemini_operator_leader", "1 while this replica leads", registry=r)
        self._states: dict[tuple[str, str], str] = {}

    def job_state(self, key: tuple[str, str], state: State | None) -> None:
        """Record a job's state (None: the job is gone) and refresh the per-state gauge."""
        if state is None:
            self._states.pop(key, None)
        else:
            self._states[key] = state.value
        for each in State:
            self.jobs.labels(state=each.value).set(
                sum(1 for s in self._states.values() if s == each.value)
            )
