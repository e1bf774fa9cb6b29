"""Writing a job's status to the API: only what differs from the status last seen, and as
stored (status_store.py: large per-rank maps go to the job's rank-detail ConfigMap).

Each reconcile makes a `JobStatusWriter` for its job: the steps set status through it (a
recovery or resume phase written ahead, before the step acts), and the reconcile writes the
final status through it. The work queue runs several jobs' reconciles at once: what one
reconcile's steps set must never land in another's, so none of it is kept in `StatusSender`,
which all of them share."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Any

from gemini_operator.cluster.cache import ClusterCache, JobKey
from gemini_operator.cluster.kube import KubeClient
from gemini_operator.cluster.status_store import StatusStore
from gemini_operator.core.outcome import Outcome
from gemini_operator.core.status import JobStatus, status_patch
from gemini_operator.core.status_changes import FinalStatus, StatusChange, final_status
from gemini_operator.core.types import JobView
from gemini_operator.runtime.metrics import OperatorMetrics


class StatusSender:
    """Sends any job's status patches; shared by every reconcile (it keeps no job's state)."""

    def __init__(self, kube: KubeClient, cache: ClusterCache, store: StatusStore,
                 metrics: OperatorMetrics) -> None:
        self.kube, self.cache, self.store, self.metrics = kube, cache, store, metrics

    def write(self, job: JobView, new: Mapping[str, Any]) -> None:
        """Write what differs between `new` and the status last seen, if anything."""
        current = self.cache.snapshot((job.namespace, job.name))
        old = current.job.get("status") if current is not None else job.status
        patch = status_patch(old, dict(new))
        if patch is not None:
            self.send(job, patch)

    def forget(self, key: JobKey) -> None:
        self.store.forget(*key)

    def send(self, job: JobView, patch: Mapping[str, Any]) -> None:
        """Apply `patch` (in terms of the full status) as stored."""
        stored = self.cache.stored_job((job.namespace, job.name)) or {
            "metadata": {"name": job.name, "namespace": job.namespace, "uid": job.uid},
            "status": job.status}
        to_send = self.store.stored_patch(stored, patch)
        if to_send is None:
            return
        updated = self.kube.patch_job_status(job.namespace, job.name, to_send)
        self.cache.update_job(updated, deleted=False)
        self.metrics.status_writes.inc()


class JobStatusWriter:
    """The status of one job in one reconcile: the decided status, the changes its steps
    set on top, and the outcomes they hand back."""

    def __init__(self, sender: StatusSender, job: JobView, decided: JobStatus,
                 clock: Callable[[], datetime]) -> None:
        self.job, self.decided = job, decided
        self.outcomes: list[Outcome] = []
        self._sender, self._clock = sender, clock
        self._changed: dict[str, Any] = {}  # top-level fields the steps set (None: removed)

    def ahead(self, change: StatusChange) -> None:
        """Write `change` now, before the step acts on it; the final write keeps it."""
        fields = change.fields(self.decided)
        self._sender.send(self.job, fields)
        self._changed.update(fields)

    def set(self, change: StatusChange) -> None:
        """Keep `change` for the final write."""
        self._changed.update(change.fields(self.decided))

    def write(self) -> FinalStatus:
        """Write the decided status with what the steps set and finished on top."""
        final = final_status(self.decided, self._changed, self.outcomes, self.job.generation,
                             self._clock)
        self._sender.write(self.job, final.document)
        return final
