"""The GeminiJob status as a frozen value, read from and written to the status subresource.

`to_dict` gives exactly the document the CRD's status schema describes; comparing two of
them decides whether a reconcile writes at all (only what changed is written).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from gemini_operator.core.conditions import Condition, state_of
from gemini_operator.core.records import (
    LastRecovery,
    LaunchRecord,
    PlacementRecord,
    RecoveryRecord,
    SparesRecord,
)

R = TypeVar("R")


@dataclass(frozen=True)
class WorkerCounts:
    total: int = 0
    active: int = 0  # pods not yet finished (pending or running)
    ready: int = 0
    succeeded: int = 0
    failed: int = 0

    def to_dict(self) -> dict[str, int]:
        return {"total": self.total, "active": self.active, "ready": self.ready,
                "succeeded": self.succeeded, "failed": self.failed}


@dataclass(frozen=True)
class ReplicaCoverage:
    """Of `total` shards, `complete` have all m in-memory copies complete, at step `step`."""

    complete: int = 0
    total: int = 0
    step: int | None = None

    def to_dict(self) -> dict[str, int]:
        out = {"complete": self.complete, "total": self.total}
        if self.step is not None:
            out["step"] = self.step
        return out

    @staticmethod
    def from_dict(raw: Mapping[str, Any] | None) -> ReplicaCoverage | None:
        if not isinstance(raw, Mapping):
            return None
        step = raw.get("step")
        return ReplicaCoverage(int(raw.get("complete", 0)), int(raw.get("total", 0)),
                               None if step is None else int(step))


@dataclass(frozen=True)
class PersistProgress:
    """An upload to S3 under way: its step, and bytes in S3 of the total over every rank."""

    step: int
    done_bytes: int
    total_bytes: int | None

    def to_dict(self) -> dict[str, Any]:
        out = {"step": self.step, "doneBytes": self.done_bytes}
        if self.total_bytes is not None:
            out["totalBytes"] = self.total_bytes
        return out

    @staticmethod
    def from_dict(raw: Mapping[str, Any] | None) -> PersistProgress | None:
        if not isinstance(raw, Mapping) or raw.get("step") is None:
            return None
        total = raw.get("totalBytes")
        return PersistProgress(int(raw["step"]), int(raw.get("doneBytes", 0)),
                               None if total is None else int(total))


@dataclass(frozen=True)
class CheckpointStatus:
    in_memory_step: int | None = None  # newest step complete in memory for every rank
    persisted_step: int | None = None  # newest step committed to S3
    persisted_time: str | None = None
    persist_error: str | None = None  # the last upload or commit failure (retried)
    persist_request: str | None = None  # the gemini.io/persist-requested value last honoured
    persist_progress: PersistProgress | None = None  # the upload under way, if any
    replica_coverage: ReplicaCoverage | None = None  # from the sidecars' inventories
    # Newest step every holder has of every shard (acknowledged): the trainers never write
    # over it. The steps between the last two snapshots (1 unless replication lags), why, and
    # how far the newest snapshot is ahead of the recoverable step.
    recoverable_step: int | None = None
    effective_interval: int | None = None
    interval_reason: str | None = None
    replication_lag_steps: int | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.in_memory_step is not None:
            out["inMemoryStep"] = self.in_memory_step
        if self.persisted_step is not None:
            out["persistedStep"] = self.persisted_step
        if self.persisted_time is not None:
            out["persistedTime"] = self.persisted_time
        if self.persist_error is not None:
            out["persistError"] = self.persist_error
        if self.persist_request is not None:
            out["persistRequest"] = self.persist_request
        if self.persist_progress is not None:
            out["persistProgress"] = self.persist_progress.to_dict()
        if self.replica_coverage is not None:
            out["replicaCoverage"] = self.replica_coverage.to_dict()
        for key, value in (("recoverableStep", self.recoverable_step),
                           ("effectiveInterval", self.effective_interval),
                           ("intervalReason", self.interval_reason),
                           ("replicationLagSteps", self.replication_lag_steps)):
            if value is not None:
                out[key] = value
        return out


@dataclass(frozen=True)
class JobStatus:
    observed_generation: int = 0
    conditions: tuple[Condition, ...] = ()
    start_time: str | None = None
    completion_time: str | None = None
    restarts: int = 0
    restart_attempt: int = 0
    workers: WorkerCounts = field(default_factory=WorkerCounts)
    checkpoint: CheckpointStatus = field(default_factory=CheckpointStatus)
    # Owned by placement, training and recovery (records.py).
    placement: PlacementRecord | None = None
    last_recovery: LastRecovery | None = None
    launch: LaunchRecord | None = None  # the training epoch the launchers run
    recovery: RecoveryRecord | None = None  # the recovery under way
    spares: SparesRecord | None = None  # placeholder pods holding spare nodes (spares.py)

    def with_changes(self, **changes: Any) -> JobStatus:
        return replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "observedGeneration": self.observed_generation,
            "state": state_of(self.conditions).value,
            "conditions": [c.to_dict() for c in self.conditions],
            "restarts": self.restarts,
            "restartAttempt": self.restart_attempt,
            "workers": self.workers.to_dict(),
            "checkpoint": self.checkpoint.to_dict(),
        }
        for key, value in (
            ("startTime", self.start_time),
            ("completionTime", self.completion_time),
            ("placement", self.placement.to_json() if self.placement else None),
            ("lastRecovery", self.last_recovery.to_json() if self.last_recovery else None),
            ("launch", self.launch.to_dict() if self.launch else None),
            ("recovery", self.recovery.to_dict() if self.recovery else None),
            ("spares", self.spares.to_json() if self.spares else None),
        ):
            if value is not None:
                out[key] = value
        return out

    @staticmethod
    def from_dict(raw: Mapping[str, Any] | None) -> JobStatus:
        raw = raw or {}
        workers = raw.get("workers") or {}
        checkpoint = raw.get("checkpoint") or {}
        return JobStatus(
            observed_generation=int(raw.get("observedGeneration", 0)),
            conditions=tuple(Condition.from_dict(c) for c in raw.get("conditions") or ()),
            start_time=raw.get("startTime"),
            completion_time=raw.get("completionTime"),
            restarts=int(raw.get("restarts", 0)),
            restart_attempt=int(raw.get("restartAttempt", 0)),
            workers=WorkerCounts(**{k: int(workers.get(k, 0)) for k in
                                    ("total", "active", "ready", "succeeded", "failed")}),
            checkpoint=CheckpointStatus(
                in_memory_step=checkpoint.get("inMemoryStep"),
                persisted_step=checkpoint.get("persistedStep"),
                persisted_time=checkpoint.get("persistedTime"),
                persist_error=checkpoint.get("persistError"),
                persist_request=checkpoint.get("persistRequest"),
                persist_progress=PersistProgress.from_dict(checkpoint.get("persistProgress")),
                replica_coverage=ReplicaCoverage.from_dict(checkpoint.get("replicaCoverage")),
                recoverable_step=checkpoint.get("recoverableStep"),
                effective_interval=checkpoint.get("effectiveInterval"),
                interval_reason=checkpoint.get("intervalReason"),
                replication_lag_steps=checkpoint.get("replicationLagSteps"),
            ),
            placement=_read(PlacementRecord.from_json, raw.get("placement")),
            last_recovery=_read(LastRecovery.from_json, raw.get("lastRecovery")),
            launch=LaunchRecord.from_dict(raw["launch"]) if raw.get("launch") else None,
            recovery=RecoveryRecord.from_dict(raw["recovery"]) if raw.get("recovery") else None,
            spares=_read(SparesRecord.from_json, raw.get("spares")),
        )


def _read(record: Callable[[object], R], doc: object) -> R | None:
    """The record of a status field (None where the status has none)."""
    return None if doc is None else record(doc)


def status_patch(old: Mapping[str, Any] | None, new: Mapping[str, Any]) -> dict[str, Any] | None:
    """A JSON merge patch from `old` to `new` (removed keys become null), or None when nothing
    changed. Lists are replaced whole; the API server merges nested documents key by key, so
    a key gone from one (checkpoint.persistError once persisting works again) is nulled too."""
    patch = _merge_diff(old or {}, new)
    return patch or None


def merge_patched(doc: Mapping[str, Any], patch: Mapping[str, Any]) -> dict[str, Any]:
    """`doc` with the JSON merge patch `patch` applied (RFC 7386), as the API server does."""
    out = dict(doc)
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, Mapping):
            before = out.get(key)
            out[key] = merge_patched(before if isinstance(before, Mapping) else {}, value)
        else:
            out[key] = value
    return out


def _merge_diff(old: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, Any]:
    patch: dict[str, Any] = {}
    for key, value in new.items():
        before = old.get(key)
        if isinstance(value, Mapping) and isinstance(before, Mapping):
            nested = _merge_diff(before, value)
            if nested:
                patch[key] = nested
        elif before != value:
            patch[key] = value
    patch.update({k: None for k in old if k not in new})
    return patch
