"""Writing a job's status to the API: only what differs from the status last seen, and as
stored (status_store.py: large per-rank maps go to the job's rank-detail ConfigMap)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gemini_operator.cluster.cache import ClusterCache, JobKey
from gemini_operator.cluster.kube import KubeClient
from gemini_operator.cluster.status_store import StatusStore
from gemini_operator.core.status import status_patch
from gemini_operator.core.types import JobView
from gemini_operator.runtime.metrics import OperatorMetrics


class StatusSender:
    """Sends any job's status patches; shared by every reconcile (it keeps no job's state)."""

    def __init__(self, kube: KubeClient, cache: ClusterCache, store: StatusStore,
                 metrics: OperatorMetrics) -> None:
        self.kube, self.cache, self.store, self.metrics = kube, cache, store, metrics

    def write(self, key: JobKey, job: JobView, new: Mapping[str, Any]) -> None:
        """Write what differs between `new` and the status last seen, if anything."""
        current = self.cache.snapshot(key)
        old = current.job.get("status") if current is not None else job.status
        patch = status_patch(old, dict(new))
        if patch is not None:
            self.send(job, patch)

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
