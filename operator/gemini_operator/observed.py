"""What the operator observes, as frozen views parsed from API objects (camelCase dicts).

Only the facts reconciliation needs: a worker pod's rank, attempt, phase, node, readiness,
how its trainer ended and why it is going away; a node's readiness and failure domains.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from gemini_operator import naming

ZONE_LABEL = "topology.kubernetes.io/zone"
RACK_LABEL = "topology.gemini.io/rack"


@dataclass(frozen=True)
class ContainerExit:
    exit_code: int
    reason: str  # the kubelet's words: Completed, Error, OOMKilled, ...


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

    @property
    def terminal(self) -> bool:
        return self.phase in ("Succeeded", "Failed")


@dataclass(frozen=True)
class NodeView:
    name: str
    ready: bool
    zone: str = ""
    rack: str = ""
    labels: Mapping[str, str] = field(default_factory=dict)


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
        ready=_condition_true(status, "Ready"),
        deleting=meta.get("deletionTimestamp") is not None,
        status_reason=str(status.get("reason") or ""),
        disruption_reason=_disruption_reason(status),
        trainer_exit=_trainer_exit(status),
        ip=str(status.get("podIP") or ""),
        owner_uid=_controller_uid(meta),
        trainer_restarts=_trainer_restarts(status),
        trainer_last_exit=_trainer_exit(status, "lastState"),
    )


def node_view(node: Mapping[str, Any]) -> NodeView:
    meta = node.get("metadata") or {}
    labels = dict(meta.get("labels") or {})
    return NodeView(
        name=str(meta.get("name", "")),
        ready=_condition_true(node.get("status") or {}, "Ready"),
        zone=labels.get(ZONE_LABEL, ""),
        rack=labels.get(RACK_LABEL, ""),
        labels=labels,
    )


def _controller_uid(meta: Mapping[str, Any]) -> str:
    for ref in meta.get("ownerReferences") or ():
        if ref.get("controller"):
            return str(ref.get("uid") or "")
    return ""


def _condition_true(status: Mapping[str, Any], kind: str) -> bool:
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
                                 str(terminated.get("reason") or ""))
    return None
