"""What `kubectl gemini` reads from API objects (camelCase dicts), with no I/O: the GeminiJob
(``JobInfo``), its current worker per rank (``WorkerInfo``) and the nodes' zone, rack and
readiness (``NodeInfo``). The views (gemini_cli.kubectl_status, gemini_cli.kubectl_plan) are
computed from these.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from gemini_operator.core import naming
from gemini_operator.core.observed import RACK_LABEL, ZONE_LABEL

PERSIST_ANNOTATION = "gemini.io/persist-requested"
FINISHED_STATES = ("Succeeded", "Failed")


@dataclass(frozen=True)
class NodeInfo:
    name: str
    zone: str = ""
    rack: str = ""
    ready: str = ""  # the Ready condition's status ("True", "False", "Unknown"), "" if none
    unschedulable: bool = False

    @property
    def down(self) -> bool:
        """A node whose Ready condition says it is not (its pods' memory is unreachable)."""
        return self.ready in ("False", "Unknown")


@dataclass(frozen=True)
class WorkerInfo:
    rank: int
    pod: str
    node: str
    phase: str
    ready: bool
    restarts: int  # container restarts (in-place training restarts are not counted here)
    attempt: int
    deleting: bool


@dataclass(frozen=True)
class JobInfo:
    name: str
    namespace: str
    replicas: int
    num_nodes: int
    suspended: bool
    persistence: bool  # spec.persistence is set: S3 checkpoints exist or can be requested
    status: Mapping[str, Any]
    annotations: Mapping[str, str]

    @property
    def state(self) -> str:
        return str(self.status.get("state") or "Unknown")


def job_info(obj: Mapping[str, Any]) -> JobInfo:
    meta = obj.get("metadata") or {}
    spec = obj.get("spec") or {}
    return JobInfo(
        name=str(meta.get("name", "")),
        namespace=str(meta.get("namespace", "")),
        replicas=int((spec.get("checkpoint") or {}).get("replicas", 2)),
        num_nodes=int(spec.get("numNodes", 0)),
        suspended=bool(spec.get("suspend", False)),
        persistence=bool(spec.get("persistence")),
        status=obj.get("status") or {},
        annotations=dict(meta.get("annotations") or {}),
    )


def node_infos(nodes: Iterable[Mapping[str, Any]]) -> dict[str, NodeInfo]:
    out: dict[str, NodeInfo] = {}
    for node in nodes:
        meta = node.get("metadata") or {}
        labels = meta.get("labels") or {}
        conditions = (node.get("status") or {}).get("conditions") or ()
        ready = next((str(c.get("status")) for c in conditions if c.get("type") == "Ready"), "")
        name = str(meta.get("name", ""))
        out[name] = NodeInfo(
            name=name,
            zone=str(labels.get(ZONE_LABEL, "")),
            rack=str(labels.get(RACK_LABEL, "")),
            ready=ready,
            unschedulable=bool((node.get("spec") or {}).get("unschedulable", False)),
        )
    return out


def worker_infos(pods: Iterable[Mapping[str, Any]]) -> dict[int, WorkerInfo]:
    """The current worker of every rank: the newest restart attempt, a live pod before one
    that is being deleted."""
    best: dict[int, WorkerInfo] = {}
    for pod in pods:
        worker = _worker(pod)
        if worker is None:
            continue
        old = best.get(worker.rank)
        if old is None or (worker.attempt, not worker.deleting) > (old.attempt, not old.deleting):
            best[worker.rank] = worker
    return dict(sorted(best.items()))


def _worker(pod: Mapping[str, Any]) -> WorkerInfo | None:
    meta = pod.get("metadata") or {}
    labels = meta.get("labels") or {}
    try:
        rank = int(labels[naming.LABEL_RANK])
        attempt = int(labels.get(naming.LABEL_RESTART_ATTEMPT, "0"))
    except (KeyError, ValueError):
        return None
    status = pod.get("status") or {}
    containers = [*(status.get("initContainerStatuses") or ()),
                  *(status.get("containerStatuses") or ())]
    return WorkerInfo(
        rank=rank,
        pod=str(meta.get("name", "")),
        node=str((pod.get("spec") or {}).get("nodeName") or ""),
        phase=str(status.get("phase") or "Pending"),
        ready=any(c.get("type") == "Ready" and c.get("status") == "True"
                  for c in status.get("conditions") or ()),
        restarts=sum(int(c.get("restartCount") or 0) for c in containers),
        attempt=attempt,
        deleting=meta.get("deletionTimestamp") is not None,
    )


def node_of(rank: int, workers: Mapping[int, WorkerInfo], placed_on: Mapping[int, str]) -> str:
    """Where a rank runs now: its current pod's node, else where the placement put it."""
    worker = workers.get(rank)
    if worker is not None and worker.node:
        return worker.node
    return placed_on.get(rank, "")


def domain_name(node: NodeInfo, level: str) -> str:
    """A node's zone or rack name; racks as ZONE/RACK (rack names repeat across zones)."""
    if level == "rack":
        return f"{node.zone}/{node.rack}" if node.rack else ""
    return str(getattr(node, level))
