"""What the training steps set in a job's status, and the status a reconcile writes last.

A step hands typed changes to the reconcile's status writer (`StatusWriter`): `ahead` for a
recovery or resume phase, written before the step acts on it (a restarted operator goes on
from the recorded phase), `set` for what the reconcile's final write carries. The final
status is the decided one with those changes and the steps' conditions on top; a change
written ahead stays in it, so the final write never takes it back."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any, Protocol

from gemini_operator.core.apitime import api_time
from gemini_operator.core.conditions import (
    JOB_FINISHED,
    RECOVERY_ABANDONED,
    RECOVERY_FINISHED,
    UNRECOVERABLE,
    Condition,
    state_of,
    upsert,
)
from gemini_operator.core.events import Event
from gemini_operator.core.outcome import Outcome
from gemini_operator.core.records import LastRecovery, LaunchRecord, PlacementRecord, RecoveryRecord
from gemini_operator.core.status import JobStatus


class StatusChange(Protocol):
    def fields(self, decided: JobStatus) -> dict[str, Any]:
        """The top-level status fields it sets (JSON; None removes one)."""
        ...


class StatusWriter(Protocol):
    """The status of the job a step acts for, in the reconcile at hand."""

    def ahead(self, change: StatusChange) -> None:
        """Written now, before the step acts on it; the final write keeps it."""

    def set(self, change: StatusChange) -> None:
        """Written by the reconcile's final write."""


@dataclass(frozen=True)
class RecoveryAt:
    """status.recovery: a recovery or resume at the phase it is about to act in."""

    record: RecoveryRecord

    def fields(self, decided: JobStatus) -> dict[str, Any]:
        return {"recovery": self.record.to_dict()}


@dataclass(frozen=True)
class RecoveryDropped:
    """status.recovery removed: nothing is left to restore (the job fails)."""

    def fields(self, decided: JobStatus) -> dict[str, Any]:
        return {"recovery": None}


@dataclass(frozen=True)
class Launched:
    """status.launch: the epoch every launcher of the attempt runs now."""

    launch: LaunchRecord

    def fields(self, decided: JobStatus) -> dict[str, Any]:
        return {"launch": self.launch.to_dict()}


@dataclass(frozen=True)
class Recovered:
    """A recovery or resume done: status.lastRecovery, the recovery record removed, the new
    launch (when training ran) and the replacements' nodes in the placement."""

    last: LastRecovery
    launch: LaunchRecord | None = None
    placement: PlacementRecord | None = None

    def fields(self, decided: JobStatus) -> dict[str, Any]:
        out: dict[str, Any] = {"lastRecovery": self.last.to_json(), "recovery": None}
        if self.launch is not None:
            out["launch"] = self.launch.to_dict()
        if self.placement is not None:
            out["placement"] = self.placement.to_json()
        return out


@dataclass(frozen=True)
class PersistedBeforeSuspend:
    """status.checkpoint: the step a suspend persisted and committed, and when."""

    step: int
    time: str

    def fields(self, decided: JobStatus) -> dict[str, Any]:
        checkpoint = replace(decided.checkpoint, persisted_step=self.step,
                             persisted_time=self.time, persist_error=None)
        return {"checkpoint": checkpoint.to_dict()}


@dataclass(frozen=True)
class FinalStatus:
    document: dict[str, Any]  # the status to write
    conditions: tuple[Condition, ...]
    events: list[Event]  # of a recovery that found nothing left to restore


def final_status(decided: JobStatus, changed: Mapping[str, Any], outcomes: Sequence[Outcome],
                 generation: int, clock: Callable[[], datetime]) -> FinalStatus:
    """The decided status with the fields the steps `changed` and what their outcomes
    finished on top."""
    new = decided.to_dict()
    conditions = decided.conditions
    events: list[Event] = []
    for outcome in outcomes:
        for extra in outcome.conditions:
            conditions = upsert(conditions, extra)
        if outcome.finished is not None:
            conditions = upsert(conditions, RECOVERY_FINISHED.condition(
                api_time(clock()), generation,
                cause=outcome.finished.message or outcome.finished.cause,
                step=outcome.finished.restored))
        if outcome.unrecoverable is not None:
            cause, why = outcome.unrecoverable
            now = api_time(clock())
            for reason, values in ((UNRECOVERABLE, {"cause": cause, "why": why}),
                                   (JOB_FINISHED, {}), (RECOVERY_ABANDONED, {})):
                conditions = upsert(conditions, reason.condition(now, generation, **values))
            new.setdefault("completionTime", now)
            events.append(Event.of_condition(UNRECOVERABLE, f"{cause}; {why}"))
    for name, value in changed.items():
        if value is None:
            new.pop(name, None)
        else:
            new[name] = value
    new["conditions"] = [c.to_dict() for c in conditions]
    new["state"] = state_of(conditions).value
    return FinalStatus(new, conditions, events)
