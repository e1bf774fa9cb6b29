"""Reconciles of different jobs run at once (the work queue's worker threads): what one
reconcile's steps write and hand back belongs to that reconcile alone."""

from __future__ import annotations

import copy
import threading
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import pytest

from gemini.domain.recovery import FailureKind
from gemini_operator.cluster.cache import ClusterCache, Snapshot
from gemini_operator.core.actions import Decision, Recover
from gemini_operator.core.events import Event, EventReason
from gemini_operator.core.outcome import Outcome
from gemini_operator.core.status import JobStatus
from gemini_operator.core.status_changes import RecoveryDropped, StatusWriter
from gemini_operator.core.types import JobView, Observed, ReconcileConfig
from gemini_operator.runtime import reconciler as reconciler_module
from gemini_operator.runtime.wiring import build_reconciler
from tests.unit.operator.fake_kube import FakeKube

NOW = datetime(2026, 1, 1, tzinfo=UTC)
JOBS = ("a", "b")
WAITS = {"a": 1.0, "b": 2.0}


def _job(name: str) -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": "ns", "uid": f"uid-{name}",
                         "generation": 1, "resourceVersion": "1"},
            "spec": {"numNodes": 1}, "status": {"state": "Recovering"}}


@dataclass(frozen=True)
class _Fields:
    """A status change given as its JSON: these tests look at whose status it lands in."""

    doc: dict[str, Any]

    def fields(self, decided: JobStatus) -> dict[str, Any]:
        return self.doc


class _InterleavedRecovery:
    """A recovery step per job that records its phase, then waits until the other job's step
    runs too (both reconciles are past their start), then hands back its own result."""

    def __init__(self, barrier: threading.Barrier) -> None:
        self.barrier = barrier

    def recover(self, job: JobView, snap: Snapshot, action: Recover, status: JobStatus,
                writer: StatusWriter) -> Outcome:
        writer.ahead(_Fields({"recovery": {"phase": f"restarting {job.name}"}}))
        self.barrier.wait()
        writer.set(_Fields({"lastRecovery": {"job": job.name}}))
        return Outcome(requeue_after=WAITS[job.name],
                       events=[Event.of(EventReason.CREATED_WORKERS, f"recovered {job.name}")])


def _always_recover(observed: Observed, config: ReconcileConfig) -> Decision:
    status = JobStatus.from_dict(observed.job.status)
    action = Recover(FailureKind.SOFTWARE, (), None)  # type: ignore[arg-type]
    return Decision(status, (action,))


def test_two_jobs_reconciled_at_once_keep_their_own_recovery_results(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(reconciler_module, "decide", _always_recover)
    kube, cache = FakeKube(jobs=[_job(name) for name in JOBS]), ClusterCache()
    for name in JOBS:
        cache.update_job(copy.deepcopy(kube.jobs[("ns", name)]), deleted=False)
    barrier = threading.Barrier(2, timeout=10)
    reconciler = build_reconciler(kube, cache, ReconcileConfig(),  # type: ignore[arg-type]
                                  clock=lambda: NOW,
                                  recovery=_InterleavedRecovery(barrier))  # type: ignore[arg-type]
    waits: dict[str, float | None] = {}
    errors: list[BaseException] = []

    def run(name: str) -> None:
        try:
            waits[name] = reconciler.reconcile(("ns", name))
        except BaseException as err:  # reported by the assertion below
            errors.append(err)

    threads = [threading.Thread(target=run, args=(name,)) for name in JOBS]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=20)
    assert not errors, errors

    for name in JOBS:
        status = kube.jobs[("ns", name)]["status"]
        assert status["lastRecovery"] == {"job": name}
        assert status["recovery"] == {"phase": f"restarting {name}"}
        assert waits[name] == WAITS[name]
        assert kube.events[("ns", name)] == [f"recovered {name}"]
        written = [p["lastRecovery"] for p in kube.patches[("ns", name)] if "lastRecovery" in p]
        assert written == [{"job": name}]


class _Unrecoverable:
    """A recovery step that finds nothing left to restore."""

    def recover(self, job: JobView, snap: Snapshot, action: Recover, status: JobStatus,
                writer: StatusWriter) -> Outcome:
        writer.set(RecoveryDropped())
        return Outcome(unrecoverable=("rank 1: node lost", "no copy of rank 1's shard is left"))


def test_an_unrecoverable_recovery_fails_the_job_and_ends_recovering(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(reconciler_module, "decide", _always_recover)
    kube, cache = FakeKube(jobs=[_job(name) for name in JOBS]), ClusterCache()
    kube.jobs[("ns", "a")]["status"] = {
        "state": "Recovering", "recovery": {"phase": "Planning"},
        "conditions": [{"type": "Recovering", "status": "True", "reason": "RecoveryNeeded",
                        "message": "x", "lastTransitionTime": "2026-01-01T00:00:00Z"}]}
    cache.update_job(copy.deepcopy(kube.jobs[("ns", "a")]), deleted=False)
    reconciler = build_reconciler(kube, cache, ReconcileConfig(),  # type: ignore[arg-type]
                                  clock=lambda: NOW, recovery=_Unrecoverable())  # type: ignore[arg-type]
    reconciler.reconcile(("ns", "a"))
    status = kube.jobs[("ns", "a")]["status"]
    conditions = {c["type"]: c for c in status["conditions"]}
    assert status["state"] == "Failed" and status.get("recovery") is None  # merge: deleted
    assert conditions["Failed"]["reason"] == "Unrecoverable"
    assert "no copy of rank 1's shard is left" in conditions["Failed"]["message"]
    assert (conditions["Recovering"]["status"], conditions["Recovering"]["reason"]) == (
        "False", "RecoveryAbandoned")
    assert any("no copy of rank 1's shard" in e for e in kube.events[("ns", "a")])
