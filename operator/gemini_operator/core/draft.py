"""The decision while `decide` builds it: `Draft` accumulates the status, actions, events and
requeue times its steps set; the helpers here are shared by the steps (decide.py,
decide_failures.py). A `Step` returns True when it settled the job (the steps after it do
not run).
"""

from __future__ import annotations

from collections.abc import Callable

from gemini_operator.core import conditions as cond
from gemini_operator.core.actions import Action, Decision, DeletePods
from gemini_operator.core.apitime import api_time
from gemini_operator.core.conditions import ConditionType, Reason
from gemini_operator.core.events import Event
from gemini_operator.core.observed import PodView
from gemini_operator.core.spec import JobSpec
from gemini_operator.core.status import JobStatus
from gemini_operator.core.types import Observed, ReconcileConfig


class Draft:
    """What the steps accumulate; turned into the frozen Decision at the end."""

    def __init__(self, observed: Observed, status: JobStatus) -> None:
        self.observed = observed
        self.now = api_time(observed.now)
        self.generation = observed.job.generation
        self.status = status
        self.actions: list[Action] = []
        self.events: list[Event] = []
        self.requeue: list[float] = []

    def set(self, reason: Reason, **values: object) -> None:
        new = reason.condition(self.now, self.generation, **values)
        self.status = self.status.with_changes(
            conditions=cond.upsert(self.status.conditions, new)
        )

    def is_true(self, kind: ConditionType) -> bool:
        return cond.is_true(self.status.conditions, kind)

    def decision(self, old: JobStatus) -> Decision:
        events = transition_events(old, self.status) + self.events
        after = min(self.requeue) if self.requeue else None
        return Decision(self.status, tuple(self.actions), tuple(events), after)


Step = Callable[[Observed, JobSpec, ReconcileConfig, Draft], bool]


def current_pods(observed: Observed, attempt: int) -> dict[int, PodView]:
    return {r: p for r, p in observed.pods.items() if p.attempt == attempt}


def delete_all(observed: Observed, reason: str) -> list[Action]:
    names = sorted(p.name for p in observed.pods.values() if not p.deleting)
    return [DeletePods(tuple(names), reason)] if names else []


def delete_active(observed: Observed, reason: str) -> list[Action]:
    """Stop the pods still running; finished ones stay for their logs and exit codes."""
    names = sorted(p.name for p in observed.pods.values() if not p.terminal and not p.deleting)
    return [DeletePods(tuple(names), reason)] if names else []


def finish(draft: Draft) -> None:
    if draft.status.completion_time is None:
        draft.status = draft.status.with_changes(completion_time=draft.now)
    draft.set(cond.JOB_FINISHED)
    if draft.is_true(ConditionType.RECOVERING):  # a finished job recovers nothing more
        draft.set(cond.RECOVERY_ABANDONED)
        draft.status = draft.status.with_changes(recovery=None)


def transition_events(old: JobStatus, new: JobStatus) -> list[Event]:
    """An event for every condition whose status or reason changed."""
    before = {c.type: (c.status, c.reason) for c in old.conditions}
    return [Event.of_change(c) for c in new.conditions
            if before.get(c.type) != (c.status, c.reason)]
