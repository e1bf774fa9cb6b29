"""What an executor of training steps (start, resume, suspend save, recovery) hands back to
the reconciler, and the ways such a step stops short."""

from __future__ import annotations

from dataclasses import dataclass, field

from gemini_operator.core.conditions import Condition
from gemini_operator.core.events import Event
from gemini_operator.core.records import LastRecovery


class RecoveryWait(Exception):
    """A phase must wait for the cluster (a pod starting, a launcher restarting)."""


class S3Unreadable(Exception):
    """The job's S3 prefix cannot be listed now (endpoint down, credentials refused)."""


class Unrecoverable(Exception):
    """No consistent step is left anywhere (memory or S3); the message says what is missing."""


@dataclass
class Outcome:
    """What a step hands back to the reconciler besides the status it set (status_changes.py):
    when to call again, the events to send, and what ended."""

    requeue_after: float | None = None
    events: list[Event] = field(default_factory=list)
    finished: LastRecovery | None = None  # status.lastRecovery when a recovery finished
    unrecoverable: tuple[str, str] | None = None  # (cause, why): the job fails
    conditions: list[Condition] = field(default_factory=list)  # set on top of the decided
