"""What the operator observes, as frozen views parsed from API objects (camelCase dicts).

Only the facts reconciliation needs: a worker pod's rank, attempt, phase, node, readiness,
how its trainer ended and why it is going away; a node's readiness and failure domains; and
when each of those failures became visible in the API (for the detection-latency metric).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from gemini_operator.core import naming
from gemini_operator.core.apitime import parse_api_time

ZONE_LABEL = "topology.kubernetes.io/zone"
RACK_LABEL = "topology.gemini.io/rack"


@dataclass(frozen=True)
class ContainerExit:
    exit_code: int
    reason: str  # the kubelet's words: Completed, Error, OOMKilled, ...
    # The termination message: with FallbackToLogsOnError (render.py) the kubelet puts the
    # last lines of the log here when the container failed.
    message: str = ""


@dataclass(frozen=True)
class PodView:
    name: str
    rank: int
    attempt: int
    uid: str
    phase: str  # Pending | Running | Succeeded | Failed | Unknown
    node_name: str = ""
    ready: bool = False
    deleting: bool = False
    status_reason: str = ""  # e.g. Evicted
    disruption_reason: str = ""  # the DisruptionTarget condition's reason, when true
    trainer_exit: ContainerExit | None = None
    ip: str = ""
    owner_uid: str = ""  # the controlling GeminiJob's uid
    # The trainer container's restarts (the launcher exits when training fails and the node
    # restarts it) and how it last ended: a software failure, seen in the pod watch.
    trainer_restarts: int = 0
    trainer_last_exit: ContainerExit | None = None
    # When the API showed each way of failing (second precision, as the API stores them).
    trainer_finished_at: datetime | None = None  # the trainer's latest termination
    disrupted_at: datetime | None = None  # the DisruptionTarget condition turned true
    delete_requested_at: datetime | None = None  # deletionTimestamp less the grace period
    # Why the pod cannot start, in the API's words ("" when nothing holds it back): the
    # scheduler cannot place it, or a container cannot be created (a missing Secret or
    # ConfigMap, an image that cannot be pulled).
    start_problem: str = ""

    @property
    def terminal(self) -> bool:
        return self.phase in ("Succeeded", "Failed")

    @property
    def training_done(self) -> bool:
        """The pod succeeded, or its trainer did while the pod waits for its sidecar to stop."""
        if self.phase == "Succeeded":
            return True
        done = self.trainer_exit
        return self.phase == "Running" and done is not None and done.exit_code == 0


@dataclass(frozen=True)
class NodeView:
    name: str
    ready: bool
    zone: str = ""
    rack: str = ""
    labels: Mapping[str, str] = field(default_factory=dict)
    ready_changed_at: datetime | None = None  # the Ready condition's lastTransitionTime
    # Not ready by the operator's own finding (silence.py) before the node controller's: the
    # job's pods there stopped answering while the API still shows them running.
    presumed_lost: bool = False


def pod_view(pod: Mapping[str, Any]) -> PodView | None:
    """The view of a worker pod; None for pods without our rank labels."""
    meta = pod.get("metadata") or {}
    labels = meta.get("labels") or {}
    try:
        rank = int(labels[naming.LABEL_RANK])
        attempt = int(labels.get(naming.LABEL_RESTART_ATTEMPT, "0"))
    except (KeyError, ValueError):
        return None
    status = pod.get("status") or {}
    return PodView(
        name=str(meta.get("name", "")),
        rank=rank,
        attempt=attempt,
        uid=str(meta.get("uid", "")),
        phase=str(status.get("phase") or "Pending"),
        node_name=str((pod.get("spec") or {}).get("nodeName") or ""),
        ready=condition_true(status, "Ready"),
        deleting=meta.get("deletionTimestamp") is not None,
        status_reason=str(status.get("reason") or ""),
        disruption_reason=_disruption_reason(status),
        trainer_exit=_trainer_exit(status),
        ip=str(status.get("podIP") or ""),
        owner_uid=controller_uid(meta),
        trainer_restarts=_trainer_restarts(status),
        trainer_last_exit=_trainer_exit(status, "lastState"),
        trainer_finished_at=_trainer_finished_at(status),
        disrupted_at=_condition_time(status, "DisruptionTarget", true_only=True),
        delete_requested_at=_delete_requested_at(meta),
        start_problem=start_problem(status),
    )


def node_view(node: Mapping[str, Any]) -> NodeView:
    meta = node.get("metadata") or {}
    labels = dict(meta.get("labels") or {})
    return NodeView(
        name=str(meta.get("name", "")),
        ready=condition_true(node.get("status") or {}, "Ready"),
        zone=labels.get(ZONE_LABEL, ""),
        rack=labels.get(RACK_LABEL, ""),
        labels=labels,
        ready_changed_at=_condition_time(node.get("status") or {}, "Ready"),
    )


def failure_visible_at(cause: str, pod: PodView | None, node: NodeView | None
                       ) -> datetime | None:
    """When the API first showed a failure of `cause` (a failurePolicy reason: NodeLost,
    PodDeleted, Evicted, Preempted, Error, OOMKilled): the node's Ready transition, the pod's
    disruption or deletion request, or the trainer's finishedAt. None when the API holds no
    such time (a pod already gone, a hang)."""
    if pod is None:
        return None
    if cause == "NodeLost":
        if node is not None and not node.ready and node.ready_changed_at is not None:
            return node.ready_changed_at
        return pod.disrupted_at or pod.delete_requested_at
    if cause in ("Evicted", "Preempted", "PodDeleted"):
        return pod.disrupted_at or pod.delete_requested_at or pod.trainer_finished_at
    if cause in ("Error", "OOMKilled"):
        return pod.trainer_finished_at
    return None


def detection_lags(failures: Iterable[tuple[int, str]], pods: Mapping[int, PodView],
                   nodes: Mapping[str, NodeView], acted: datetime,
                   parked_at: Mapping[int, datetime] | None = None) -> dict[str, float]:
    """Seconds from the earliest visible failure of each cause among `failures` ((rank,
    cause) pairs) to `acted`: in the API, or else when the rank's launcher parked the failed
    epoch (`parked_at`: a process that failed without its container stopping shows in no API
    time). Causes without a time are left out. Never negative (the API's times are whole
    seconds)."""
    first: dict[str, datetime] = {}
    parked = parked_at or {}
    for rank, cause in failures:
        pod = pods.get(rank)
        seen = failure_visible_at(cause, pod, nodes.get(pod.node_name) if pod else None)
        seen = seen or parked.get(rank)
        if seen is not None and (cause not in first or seen < first[cause]):
            first[cause] = seen
    return {cause: max(0.0, (acted - seen).total_seconds()) for cause, seen in first.items()}


def _condition_time(status: Mapping[str, Any], kind: str, true_only: bool = False
                    ) -> datetime | None:
    for cond in status.get("conditions") or ():
        if cond.get("type") == kind and (cond.get("status") == "True" or not true_only):
            return parse_api_time(cond.get("lastTransitionTime"))
    return None


def _delete_requested_at(meta: Mapping[str, Any]) -> datetime | None:
    """deletionTimestamp is the end of the grace period; the request came that much earlier."""
    when = parse_api_time(meta.get("deletionTimestamp"))
    if when is None:
        return None
    return when - timedelta(seconds=int(meta.get("deletionGracePeriodSeconds") or 0))


def _trainer_finished_at(status: Mapping[str, Any]) -> datetime | None:
    for container in status.get("containerStatuses") or ():
        if container.get("name") != naming.TRAINER_CONTAINER:
            continue
        for key in ("state", "lastState"):
            finished = parse_api_time(((container.get(key) or {}).get("terminated") or {}).get(
                "finishedAt"))
            if finished is not None:
                return finished
    return None


def controller_uid(meta: Mapping[str, Any]) -> str:
    for ref in meta.get("ownerReferences") or ():
        if ref.get("controller"):
            return str(ref.get("uid") or "")
    return ""


def condition_true(status: Mapping[str, Any], kind: str) -> bool:
    return any(
        c.get("type") == kind and c.get("status") == "True" for c in status.get("conditions") or ()
    )


def _disruption_reason(status: Mapping[str, Any]) -> str:
    for cond in status.get("conditions") or ():
        if cond.get("type") == "DisruptionTarget" and cond.get("status") == "True":
            return str(cond.get("reason") or "")
    return ""


def _trainer_restarts(status: Mapping[str, Any]) -> int:
    for container in status.get("containerStatuses") or ():
        if container.get("name") == naming.TRAINER_CONTAINER:
            return int(container.get("restartCount") or 0)
    return 0


def _trainer_exit(status: Mapping[str, Any], key: str = "state") -> ContainerExit | None:
    for container in status.get("containerStatuses") or ():
        if container.get("name") != naming.TRAINER_CONTAINER:
            continue
        terminated = (container.get(key) or {}).get("terminated")
        if terminated:
            return ContainerExit(int(terminated.get("exitCode", 0)),
                                 str(terminated.get("reason") or ""),
                                 str(terminated.get("message") or ""))
    return None


# Container waiting reasons that do not pass by themselves: the pod needs a fix from outside.
CANNOT_START_REASONS = frozenset({
    "CreateContainerConfigError", "CreateContainerError", "ErrImagePull", "ImagePullBackOff",
    "InvalidImageName", "ErrImageNeverPull", "RunContainerError",
})


def start_problem(status: Mapping[str, Any]) -> str:
    """Why a pod cannot start, naming the cause as the API gives it; "" when nothing holds
    it back. The scheduler's verdict first (no container runs before it), then the first
    container (init containers too: the sidecar is one) that cannot be created."""
    for cond in status.get("conditions") or ():
        if (cond.get("type"), cond.get("status"), cond.get("reason")) == (
                "PodScheduled", "False", "Unschedulable"):
            return f"cannot be scheduled: {cond.get('message') or 'no node fits'}"
    for key in ("initContainerStatuses", "containerStatuses"):
        for container in status.get(key) or ():
            waiting = (container.get("state") or {}).get("waiting") or {}
            reason = str(waiting.get("reason") or "")
            if reason in CANNOT_START_REASONS:
                message = str(waiting.get("message") or "").strip()
                detail = f": {message}" if message else ""
                return f"container {container.get('name')} cannot start: {reason}{detail}"
    return ""
