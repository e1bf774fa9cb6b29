"""What one reconcile decides from: the GeminiJob as a view (`JobView`), everything observed
about it (`Observed`: its pods, nodes, children, the workers' findings, the time) and the
operator's settings (`ReconcileConfig`). Frozen values; `decide.decide` reads them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from gemini import rank_detail
from gemini_operator.core import queueing, render
from gemini_operator.core.failures import Progress
from gemini_operator.core.observed import NodeView, PodView
from gemini_operator.core.queueing import WorkloadView
from gemini_operator.core.spares import SpareView
from gemini_operator.core.status import CheckpointStatus


@dataclass(frozen=True)
class JobView:
    name: str
    namespace: str
    uid: str
    generation: int
    spec: Mapping[str, Any]
    status: Mapping[str, Any] | None = None
    labels: Mapping[str, str] = field(default_factory=dict)

    @property
    def ref(self) -> render.JobRef:
        return render.JobRef(self.name, self.namespace, self.uid)

    @staticmethod
    def from_object(obj: Mapping[str, Any]) -> JobView:
        meta = obj.get("metadata") or {}
        return JobView(
            name=str(meta.get("name", "")),
            namespace=str(meta.get("namespace", "")),
            uid=str(meta.get("uid", "")),
            generation=int(meta.get("generation", 0)),
            spec=obj.get("spec") or {},
            status=obj.get("status"),
            labels=dict(meta.get("labels") or {}),
        )


@dataclass(frozen=True)
class Observed:
    job: JobView
    pods: Mapping[int, PodView]  # the worker pod of each rank (one name per rank)
    nodes: Mapping[str, NodeView]
    has_service: bool
    has_secret: bool
    now: datetime
    pending_creates: frozenset[int] = frozenset()  # created by us, not yet seen in the cache
    has_network_policy: bool = False
    # Ranks whose pod name is still taken by a pod of an earlier job of the same name.
    foreign_ranks: frozenset[int] = frozenset()
    process_exits: Mapping[int, int] = field(default_factory=dict)  # from the launchers
    # Ranks whose training failed while their launcher stays up (poller.py), with the
    # launcher's words; those also in process_exits exited, the others are parked alive.
    parked: Mapping[int, str] = field(default_factory=dict)
    progress: Progress | None = None
    checkpoint: CheckpointStatus | None = None  # from the sidecars (poller.py)
    spares: Mapping[int, SpareView] = field(default_factory=dict)  # by spare index
    # The API server refused a worker pod rendered from this spec (422): its message.
    pod_refused: str | None = None
    # A child's name (Secret, Service, NetworkPolicy, rank-detail ConfigMap) taken by an
    # object the job does not own, in words: the job fails naming it.
    child_conflict: str | None = None
    # The job's Kueue Workload, read when the job names a queue (queueing.py).
    workload: WorkloadView | None = None

    @property
    def queue(self) -> str | None:
        return queueing.queue_name(self.job.labels)


@dataclass(frozen=True)
class ReconcileConfig:
    render: render.RenderConfig = field(default_factory=render.RenderConfig)
    default_sidecar_image: str | None = None
    token_key: bytes | None = field(default=None, repr=False)  # tokens.py
    # Per-rank status detail larger than this goes to a ConfigMap (gemini.rank_detail).
    status_inline_bytes: int = rank_detail.DEFAULT_INLINE_BYTES
