"""Every event the operator sends about a GeminiJob: one reason table and one event type.

A condition change is an event too, with the condition's reason (conditions.py defines those);
`EventReason` lists the events that set no condition. Whether an event is a Warning is fixed
by its reason, here or in the condition's `Reason`.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from gemini_operator.core.conditions import Condition, Reason, is_warning


class EventReason(StrEnum):
    CREATED_WORKERS = "CreatedWorkers"
    PLACEMENT_COMPUTED = "PlacementComputed"
    PERSIST_FAILED = "PersistFailed"
    PERSIST_RECOVERED = "PersistRecovered"
    SPARES_CREATED = "SparesCreated"
    SPARES_HELD = "SparesHeld"
    SPARES_UNSCHEDULABLE = "SparesUnschedulable"
    TRAINING_STARTED = "TrainingStarted"
    RESUMED_FROM_CHECKPOINT = "ResumedFromCheckpoint"
    RESUMED_WITHOUT_CHECKPOINT = "ResumedWithoutCheckpoint"
    RESUME_WAITING_FOR_S3 = "ResumeWaitingForS3"
    SUSPEND_CHECKPOINT_SAVED = "SuspendCheckpointSaved"
    SUSPEND_CHECKPOINT_FAILED = "SuspendCheckpointFailed"
    SUSPENDED_WITHOUT_CHECKPOINT = "SuspendedWithoutCheckpoint"
    CHECKPOINT_INTERVAL_LENGTHENED = "CheckpointIntervalLengthened"
    CHECKPOINT_INTERVAL_RESTORED = "CheckpointIntervalRestored"
    WORKLOAD_CREATED = "WorkloadCreated"
    WORKLOAD_UPDATED = "WorkloadUpdated"
    QUEUE_UNAVAILABLE = "QueueUnavailable"


WARNINGS = frozenset({
    EventReason.PERSIST_FAILED,
    EventReason.SPARES_UNSCHEDULABLE,
    EventReason.RESUMED_WITHOUT_CHECKPOINT,
    EventReason.RESUME_WAITING_FOR_S3,
    EventReason.SUSPEND_CHECKPOINT_FAILED,
    EventReason.SUSPENDED_WITHOUT_CHECKPOINT,
    EventReason.CHECKPOINT_INTERVAL_LENGTHENED,
    EventReason.QUEUE_UNAVAILABLE,
})


@dataclass(frozen=True)
class Event:
    reason: str
    message: str
    warning: bool = False

    @staticmethod
    def of(reason: EventReason, message: str) -> Event:
        return Event(reason.value, message, reason in WARNINGS)

    @staticmethod
    def of_condition(reason: Reason, message: str) -> Event:
        """An event in the words of a condition reason (its own message, not the template's)."""
        return Event(reason.reason, message, reason.warning)

    @staticmethod
    def of_change(condition: Condition) -> Event:
        """The event for a condition whose status or reason changed."""
        return Event(condition.reason, condition.message, is_warning(condition.reason))
