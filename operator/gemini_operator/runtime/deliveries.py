"""Delivering a job's published placement to its sidecars (`DeliverPlacement`), off the
reconcile path (background.py): a reconcile never waits on sidecars. The call's end wakes the
job, whose next reconcile records the outcome in the PlacementDelivered condition. Sidecars
that do not answer (not started yet, a cut-off node, fake nodes) leave the status written and
are retried after 0.5, 1, 2, ... 30 s: the back-off is kept here, per job."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from datetime import datetime

from gemini_operator.calls import placement_delivery
from gemini_operator.calls.background import BackgroundCalls, Finished, Running
from gemini_operator.calls.sidecars import DELIVERY_TIMEOUT_SECONDS, DeliveryError
from gemini_operator.calls.tokens import JobTokens
from gemini_operator.cluster.cache import JobKey, Snapshot
from gemini_operator.core.actions import DeliverPlacement
from gemini_operator.core.apitime import api_time
from gemini_operator.core.conditions import (
    PLACEMENT_DELIVERED,
    SIDECARS_UNREACHABLE,
    Condition,
    ConditionType,
    find,
)
from gemini_operator.core.events import Event
from gemini_operator.core.outcome import Outcome
from gemini_operator.core.render import RenderConfig
from gemini_operator.core.status import JobStatus
from gemini_operator.core.types import JobView
from gemini_operator.runtime.status_writer import JobStatusWriter

RETRY_SECONDS, RETRY_MAX_SECONDS = 0.5, 30.0


class PlacementDeliveries:
    def __init__(self, tokens: JobTokens, render: RenderConfig, calls: BackgroundCalls,
                 clock: Callable[[], datetime]) -> None:
        self.tokens, self.render, self.calls, self._clock = tokens, render, calls, clock
        self._backoff: dict[JobKey, tuple[int, float]] = {}  # failures, monotonic next try

    def deliver(self, writer: JobStatusWriter, job: JobView, snap: Snapshot,
                action: DeliverPlacement) -> None:
        """Start the delivery, or record how the one started for this placement went."""
        key = (job.namespace, job.name)
        pods = dict(snap.pods)
        # A result counts only for the placement and the pods it was sent to.
        what = json.dumps([action.placement, {r: p.ip for r, p in pods.items()}],
                          sort_keys=True)
        call = self.calls.take(key, what)
        if isinstance(call, Running):  # its end wakes the job; the requeue is a safety net
            writer.outcomes.append(Outcome(requeue_after=DELIVERY_TIMEOUT_SECONDS + 1.0))
            return
        if isinstance(call, Finished):
            self._delivered(writer, job, call)
            return
        _, due = self._backoff.get(key, (0, 0.0))
        if due > time.monotonic():
            writer.outcomes.append(Outcome(requeue_after=due - time.monotonic()))
            return
        token = self.tokens.of(job.ref)
        if token is None:
            raise RuntimeError(f"the peer-auth Secret of {job.namespace}/{job.name} is missing")

        def deliver() -> int:
            return placement_delivery.deliver(action.record.layout, pods, self.render, token)

        self.calls.start(key, what, deliver)

    def forget(self, key: JobKey) -> None:
        self._backoff.pop(key, None)
        self.calls.forget(key)

    def _delivered(self, writer: JobStatusWriter, job: JobView, call: Finished) -> None:
        """Record how a finished delivery went; a failed one is retried after a backoff."""
        key = (job.namespace, job.name)
        now = api_time(self._clock())
        error = call.error
        if error is None:
            self._backoff.pop(key, None)
            new = PLACEMENT_DELIVERED.condition(now, job.generation, ranks=call.value)
            writer.outcomes.append(Outcome(conditions=[new],
                                           events=_changed(writer.decided, new)))
            return
        if not isinstance(error, DeliveryError):
            raise error
        failures, _ = self._backoff.get(key, (0, 0.0))
        delay = min(RETRY_SECONDS * 2 ** failures, RETRY_MAX_SECONDS)
        self._backoff[key] = (failures + 1, time.monotonic() + delay)
        new = SIDECARS_UNREACHABLE.condition(now, job.generation, failed=error.failed,
                                             ranks=error.total, detail=str(error)[:2000])
        writer.outcomes.append(Outcome(requeue_after=delay, conditions=[new],
                                       events=_changed(writer.decided, new)))


def _changed(decided: JobStatus, new: Condition) -> list[Event]:
    """An event for a condition set here, when its reason changes."""
    old = find(decided.conditions, ConditionType(new.type))
    if old is not None and (old.status, old.reason) == (new.status, new.reason):
        return []
    return [Event.of_change(new)]
