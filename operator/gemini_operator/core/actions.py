"""What a decision asks the executor to do (one dataclass per action; `reconciler.py` maps
each type to its handler, `steps/` runs the training steps among them) and the `Decision`
itself: the actions, the new status and the events to send after the write.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gemini.domain.recovery import FailureKind
from gemini_operator.core.events import Event
from gemini_operator.core.failures import RankFailure
from gemini_operator.core.records import PlacementRecord
from gemini_operator.core.spares import HoldSpares
from gemini_operator.core.spec import JobSpec
from gemini_operator.core.status import JobStatus

Manifest = dict[str, Any]


# Actions: what the executor does, in this order.
@dataclass(frozen=True)
class CreateSecret:
    """The per-job peer-auth Secret; the executor generates the token."""


@dataclass(frozen=True)
class CreateService:
    manifest: Manifest


@dataclass(frozen=True)
class CreateNetworkPolicy:
    manifest: Manifest


@dataclass(frozen=True)
class CreatePods:
    manifests: tuple[Manifest, ...]


@dataclass(frozen=True)
class DeletePods:
    names: tuple[str, ...]
    reason: str


@dataclass(frozen=True)
class DeliverPlacement:
    """Tell every sidecar whose shards it holds and where its peers are."""

    record: PlacementRecord

    @property
    def placement(self) -> dict[str, Any]:
        """The placement as published in status (a delivery is known by it)."""
        return self.record.to_json()


@dataclass(frozen=True)
class Recover:
    """Recover from `failures` (planned with gemini.domain's planner by the executor, which
    reads the sidecars' inventory first)."""

    kind: FailureKind
    failures: tuple[RankFailure, ...]
    spec: JobSpec


@dataclass(frozen=True)
class SaveBeforeSuspend:
    """Persist and commit the newest step complete in memory before the pods are deleted
    (bounded; the executor says in events what was kept)."""

    spec: JobSpec


@dataclass(frozen=True)
class StartTraining:
    """Every worker runs and has its placement: tell every launcher to start epoch 1 (or,
    after a suspend, restore the committed step first)."""

    spec: JobSpec


@dataclass(frozen=True)
class DeleteJob:
    """The TTL after finishing has passed."""


@dataclass(frozen=True)
class CreateWorkload:
    """The job's Kueue Workload (queueing.py)."""

    manifest: Manifest


@dataclass(frozen=True)
class DeleteWorkload:
    """The Workload of a job the user suspended, once its pods are gone (a suspended job
    holds no quota: resuming makes a new one, queued again), of a job no longer labelled for
    a queue, or one made for an older version of a waiting job (made again)."""

    name: str
    why: str


@dataclass(frozen=True)
class PatchWorkload:
    """A status patch of the job's Workload: finished, or its quota handed back."""

    name: str
    patch: Manifest
    what: str


Action = (
    CreateSecret | CreateService | CreateNetworkPolicy | CreatePods | DeletePods
    | DeliverPlacement | Recover | StartTraining | DeleteJob | HoldSpares | SaveBeforeSuspend
    | CreateWorkload | PatchWorkload | DeleteWorkload
)


@dataclass(frozen=True)
class Decision:
    status: JobStatus
    actions: tuple[Action, ...] = ()
    events: tuple[Event, ...] = ()
    requeue_after: float | None = None  # seconds until the next time-based check
