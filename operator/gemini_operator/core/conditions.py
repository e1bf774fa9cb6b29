"""Condition types, reasons and messages: defined once, here.

Each `Reason` fixes the condition type it sets, the status it gives it, a CamelCase reason
and a lower-case message template. `Reason.condition(...)` fills the template; `upsert`
keeps `lastTransitionTime` when the status does not change, as Kubernetes conventions ask.
`state_of` folds the conditions into the one word `kubectl get` shows.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any


class ConditionType(StrEnum):
    CREATED = "Created"
    RUNNING = "Running"
    RECOVERING = "Recovering"
    SUCCEEDED = "Succeeded"
    # Set with Succeeded, under a batch/v1 Job's name for it: `kubectl wait
    # --for=condition=Complete` and tools written for Jobs work as they do there.
    COMPLETE = "Complete"
    FAILED = "Failed"
    SUSPENDED = "Suspended"
    # Whether every sidecar has the current status.placement (published before delivery).
    PLACEMENT_DELIVERED = "PlacementDelivered"


class State(StrEnum):
    """status.state: the summary `kubectl get geminijobs` prints."""

    CREATED = "Created"
    RUNNING = "Running"
    RECOVERING = "Recovering"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    SUSPENDED = "Suspended"


@dataclass(frozen=True)
class Condition:
    type: str
    status: str  # "True" | "False" | "Unknown"
    reason: str
    message: str
    last_transition_time: str
    observed_generation: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "type": self.type,
            "status": self.status,
            "reason": self.reason,
            "message": self.message,
            "lastTransitionTime": self.last_transition_time,
            "observedGeneration": self.observed_generation,
        }

    @staticmethod
    def from_dict(raw: Mapping[str, Any]) -> Condition:
        return Condition(
            type=str(raw.get("type", "")),
            status=str(raw.get("status", "Unknown")),
            reason=str(raw.get("reason", "")),
            message=str(raw.get("message", "")),
            last_transition_time=str(raw.get("lastTransitionTime", "")),
            observed_generation=int(raw.get("observedGeneration", 0)),
        )


@dataclass(frozen=True)
class Reason:
    """One reason for a condition: the type it sets, to which status, and the message."""

    type: ConditionType
    status: bool
    reason: str
    template: str
    warning: bool = False  # the event for it is of type Warning

    def message(self, **values: object) -> str:
        return self.template.format(**values)

    def condition(self, now: str, generation: int, **values: object) -> Condition:
        return Condition(
            self.type.value, "True" if self.status else "False", self.reason,
            self.message(**values), now, generation,
        )


T = ConditionType
CHILDREN_CREATED = Reason(
    T.CREATED, True, "ChildrenCreated",
    "created {workers} worker pods, the headless service and the peer-auth secret",
)
WORKERS_DELETED = Reason(
    T.CREATED, False, "WorkersDeleted", "the worker pods were deleted because the job is suspended"
)
WORKERS_STARTING = Reason(
    T.RUNNING, False, "WorkersStarting", "{ready} of {total} workers are ready"
)
WORKERS_CANNOT_START = Reason(
    T.RUNNING, False, "WorkersCannotStart", "pod {pod} {problem}{more}", warning=True,
)
ALL_WORKERS_READY = Reason(T.RUNNING, True, "AllWorkersReady", "all {total} workers are ready")
WORKERS_FINISHING = Reason(
    T.RUNNING, True, "WorkersFinishing", "{succeeded} of {total} workers finished training; the "
    "job ends when every pod has",
)
JOB_FINISHED = Reason(T.RUNNING, False, "JobFinished", "the job has finished")
JOB_SUSPENDED = Reason(
    T.SUSPENDED, True, "JobSuspended", "the job is suspended: its worker pods are deleted"
)
JOB_RESUMED = Reason(T.SUSPENDED, False, "JobResumed", "the job was resumed")
# Held by Kueue (queueing.py): the job runs once its Workload is admitted.
JOB_QUEUED = Reason(T.SUSPENDED, True, "WaitingForAdmission", "the job is {why}")
JOB_ADMITTED = Reason(T.SUSPENDED, False, "Admitted", "admitted by Kueue (Workload {workload})")
JOB_LEFT_QUEUE = Reason(
    T.SUSPENDED, False, "LeftQueue",
    "the kueue.x-k8s.io/queue-name label was removed: the job runs outside Kueue's quota",
)
RUNNING_SUSPENDED = Reason(T.RUNNING, False, "JobSuspended", "the job is suspended")
RECOVERY_NEEDED = Reason(T.RECOVERING, True, "RecoveryNeeded", "{cause}; {intent}", warning=True)
RECOVERY_FINISHED = Reason(
    T.RECOVERING, False, "RecoveryFinished", "recovered from {cause}; restored step {step}"
)
RECOVERY_ABANDONED = Reason(
    T.RECOVERING, False, "RecoveryAbandoned",
    "the job ended before the recovery finished (see the Failed or Succeeded condition)",
)
RECOVERY_SUSPENDED = Reason(
    T.RECOVERING, False, "RecoverySuspended",
    "the job was suspended during a recovery; resume restores the newest committed step",
)
ALL_WORKERS_SUCCEEDED = Reason(
    T.SUCCEEDED, True, "AllWorkersSucceeded", "all {total} workers finished successfully"
)
JOB_COMPLETE = Reason(
    T.COMPLETE, True, "AllWorkersSucceeded", "all {total} workers finished successfully"
)
INVALID_SPEC = Reason(
    T.FAILED, True, "InvalidSpec", "the spec cannot be run: {detail}", warning=True
)
DEADLINE_EXCEEDED = Reason(
    T.FAILED, True, "DeadlineExceeded",
    "the job ran longer than spec.activeDeadlineSeconds ({seconds} s)", warning=True,
)
MAX_RESTARTS_EXCEEDED = Reason(
    T.FAILED, True, "MaxRestartsExceeded",
    "{cause}; no recovery left after {restarts} (spec.failurePolicy.maxRestarts){log}",
    warning=True,
)
FAILURE_POLICY_FAIL_JOB = Reason(
    T.FAILED, True, "FailurePolicyRuleMatched",
    "{cause}; failure policy rule {rule} fails the job{log}", warning=True,
)
UNRECOVERABLE = Reason(T.FAILED, True, "Unrecoverable", "{cause}; {why}", warning=True)
PLACEMENT_PENDING = Reason(
    T.PLACEMENT_DELIVERED, False, "PlacementPending",
    "the placement of {ranks} ranks is published; it goes to the sidecars once every worker runs",
)
PLACEMENT_DELIVERED = Reason(
    T.PLACEMENT_DELIVERED, True, "PlacementDelivered",
    "all {ranks} sidecars have their peers and the shards they hold",
)
SIDECARS_UNREACHABLE = Reason(
    T.PLACEMENT_DELIVERED, False, "SidecarsUnreachable",
    "{failed} of {ranks} sidecars did not take the placement (retrying): {detail}", warning=True,
)

# Terminal condition types: once True, the job is finished.
FINISHED_TYPES = (ConditionType.SUCCEEDED, ConditionType.FAILED)
_WARNING_REASONS = frozenset(
    r.reason for r in tuple(globals().values()) if isinstance(r, Reason) and r.warning)


def is_warning(reason: str) -> bool:
    """Whether the event for a condition that changes to this reason is a Warning."""
    return reason in _WARNING_REASONS


def upsert(conditions: Sequence[Condition], new: Condition) -> tuple[Condition, ...]:
    """`conditions` with `new` in place of its type; the transition time moves only when the
    status changes."""
    out: list[Condition] = []
    replaced = False
    for old in conditions:
        if old.type != new.type:
            out.append(old)
            continue
        replaced = True
        if old.status == new.status:
            new = Condition(new.type, new.status, new.reason, new.message,
                            old.last_transition_time, new.observed_generation)
        out.append(new)
    if not replaced:
        out.append(new)
    return tuple(out)


def find(conditions: Sequence[Condition], kind: ConditionType) -> Condition | None:
    return next((c for c in conditions if c.type == kind.value), None)


def is_true(conditions: Sequence[Condition], kind: ConditionType) -> bool:
    found = find(conditions, kind)
    return found is not None and found.status == "True"


def state_of(conditions: Sequence[Condition]) -> State:
    """The most telling true condition: finished beats suspended beats recovering beats
    running; a job with none of them true is Created."""
    for kind, state in (
        (ConditionType.FAILED, State.FAILED),
        (ConditionType.SUCCEEDED, State.SUCCEEDED),
        (ConditionType.SUSPENDED, State.SUSPENDED),
        (ConditionType.RECOVERING, State.RECOVERING),
        (ConditionType.RUNNING, State.RUNNING),
    ):
        if is_true(conditions, kind):
            return state
    return State.CREATED
