"""What the watches have shown: GeminiJobs, their worker pods (and spare placeholder pods,
spares.py), and nodes, indexed for reconcile.

Updated from kopf's watch events on the event loop, read by reconciles in worker threads, so
every access holds one lock. Each update returns the jobs it concerns, which the caller
queues: a pod event concerns its job; a node event concerns the jobs with pods on that node,
and only when the node's readiness or labels changed (heartbeats change neither).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

from gemini_operator.core import naming
from gemini_operator.core.observed import NodeView, PodView, node_view, pod_view
from gemini_operator.core.spares import SpareView, spare_view

JobKey = tuple[str, str]  # (namespace, name)


@dataclass(frozen=True)
class Snapshot:
    job: Mapping[str, Any]
    pods: Mapping[int, PodView]
    nodes: Mapping[str, NodeView]
    spares: Mapping[int, SpareView] = field(default_factory=dict)  # placeholder pods by index
    has_workload: bool = False  # a Kueue Workload made for the job exists (its watch says)


class ClusterCache:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs: dict[JobKey, dict[str, Any]] = {}
        self._pods: dict[JobKey, dict[int, PodView]] = {}
        self._nodes: dict[str, NodeView] = {}
        self._spares: dict[JobKey, dict[int, SpareView]] = {}
        self._workloads: dict[JobKey, set[str]] = {}  # names of the jobs' Kueue Workloads
        # node -> (until, in monotonic seconds; since): presumed lost by the poller
        self._presumed: dict[str, tuple[float, datetime]] = {}
        self._answered: set[str] = set()  # uids of worker pods whose sidecar answered
        # The job as reconciles read it: the stored one with its per-rank detail joined in
        # (status_store.py); it may read the API, so it runs outside the lock.
        self._full_job: Callable[[Mapping[str, Any]], Mapping[str, Any]] = lambda job: job

    def read_jobs_through(self, full_job: Callable[[Mapping[str, Any]], Mapping[str, Any]]
                          ) -> None:
        self._full_job = full_job

    def heard_from(self, uids: Iterable[str]) -> None:
        """These pods' sidecars answered: a pod silent later was up before (silence.py)."""
        with self._lock:
            self._answered.update(uids)

    def has_answered(self, uid: str) -> bool:
        with self._lock:
            return uid in self._answered

    def presume_lost(self, node: str, since: datetime, seconds: float) -> None:
        """Show `node` as not ready for `seconds` (silence.py): its pods fell silent in a way
        only a lost node explains, and the node controller is slower to tell."""
        with self._lock:
            self._presumed[node] = (time.monotonic() + seconds, since)

    def _nodes_seen(self) -> dict[str, NodeView]:
        now = time.monotonic()
        self._presumed = {n: p for n, p in self._presumed.items() if p[0] > now}
        nodes = dict(self._nodes)
        for name, (_, since) in self._presumed.items():
            view = nodes.get(name)
            if view is not None and view.ready:
                nodes[name] = replace(view, ready=False, presumed_lost=True,
                                      ready_changed_at=since)
        return nodes

    def update_job(self, obj: Mapping[str, Any], deleted: bool) -> list[JobKey]:
        key = _key(obj)
        with self._lock:
            if deleted:
                self._jobs.pop(key, None)
            elif not _older(obj, self._jobs.get(key)):
                self._jobs[key] = dict(obj)
        return [key]

    def update_pod(self, obj: Mapping[str, Any], deleted: bool) -> list[JobKey]:
        meta = obj.get("metadata") or {}
        job = (meta.get("labels") or {}).get(naming.LABEL_JOB)
        view = pod_view(obj)
        if job and view is None:
            return self._update_spare(obj, str(job), deleted)
        if not job or view is None:
            return []
        key = (str(meta.get("namespace", "")), str(job))
        with self._lock:
            pods = self._pods.setdefault(key, {})
            if deleted:
                self._answered.discard(view.uid)
                if pods.get(view.rank, view).uid == view.uid:
                    pods.pop(view.rank, None)
            else:
                pods[view.rank] = view
        return [key]

    def _update_spare(self, obj: Mapping[str, Any], job: str, deleted: bool) -> list[JobKey]:
        spare = spare_view(obj)
        if spare is None:
            return []
        key = (str((obj.get("metadata") or {}).get("namespace", "")), job)
        with self._lock:
            held = self._spares.setdefault(key, {})
            if not deleted:
                held[spare.index] = spare
            elif held.get(spare.index, spare).uid == spare.uid:
                held.pop(spare.index, None)
        return [key]

    def update_workload(self, obj: Mapping[str, Any], deleted: bool) -> list[JobKey]:
        """A Workload labelled with its job: kept by name, so that a job no longer labelled
        for a queue still finds (and deletes) it."""
        meta = obj.get("metadata") or {}
        job = (meta.get("labels") or {}).get(naming.LABEL_JOB)
        if not job:
            return []
        key = (str(meta.get("namespace", "")), str(job))
        with self._lock:
            names = self._workloads.setdefault(key, set())
            if deleted:
                names.discard(str(meta.get("name")))
                if not names:
                    del self._workloads[key]
            else:
                names.add(str(meta.get("name")))
        return [key]

    def update_node(self, obj: Mapping[str, Any], deleted: bool) -> list[JobKey]:
        view = node_view(obj)
        with self._lock:
            old = self._nodes.get(view.name)
            if deleted:
                self._nodes.pop(view.name, None)
            else:
                self._nodes[view.name] = view
            if old is not None and not deleted and (old.ready, old.labels) == (
                view.ready, view.labels
            ):
                return []
            keys = {key for key, pods in self._pods.items()
                    if any(p.node_name == view.name for p in pods.values())}
            keys |= {key for key, held in self._spares.items()
                     if any(s.node_name == view.name for s in held.values())}
            return sorted(keys)

    def replace_pods(self, key: JobKey, objs: list[dict[str, Any]]) -> None:
        """The job's pods as just listed from the API (a watch may have missed a deletion,
        or not have listed everything yet right after start-up)."""
        views = [v for v in (pod_view(o) for o in objs) if v is not None]
        with self._lock:
            self._pods[key] = {v.rank: v for v in views}

    def replace_ranks(self, key: JobKey, ranks: set[int], objs: list[dict[str, Any]]) -> None:
        """`replace_pods` for the pods of `ranks` only (listed with a rank selector)."""
        views = [v for v in (pod_view(o) for o in objs) if v is not None and v.rank in ranks]
        with self._lock:
            pods = self._pods.setdefault(key, {})
            for rank in ranks:
                pods.pop(rank, None)
            pods.update({v.rank: v for v in views})

    def snapshot(self, key: JobKey) -> Snapshot | None:
        """The job (with its full status), its pods and spares, and the nodes."""
        with self._lock:
            job = self._jobs.get(key)
            if job is None:
                return None
            snap = Snapshot(job, dict(self._pods.get(key, {})), self._nodes_seen(),
                            dict(self._spares.get(key, {})), bool(self._workloads.get(key)))
        return replace(snap, job=self._full_job(job))

    def stored_job(self, key: JobKey) -> Mapping[str, Any] | None:
        """The job as the API server stores it (the status may name its detail)."""
        with self._lock:
            return self._jobs.get(key)

    def forget(self, key: JobKey) -> None:
        with self._lock:
            self._jobs.pop(key, None)
            self._pods.pop(key, None)
            self._spares.pop(key, None)
            self._workloads.pop(key, None)

    def job_keys(self) -> list[JobKey]:
        with self._lock:
            return list(self._jobs)


def _key(obj: Mapping[str, Any]) -> JobKey:
    meta = obj.get("metadata") or {}
    return (str(meta.get("namespace", "")), str(meta.get("name", "")))


def _older(new: Mapping[str, Any], cached: Mapping[str, Any] | None) -> bool:
    """Whether `new` is an older version than `cached`: our own status write goes into the
    cache at once, and a watch event from before it must not undo it. Resource versions are
    etcd revisions in practice; when they are not numbers, newest-arrived wins."""
    if cached is None:
        return False
    try:
        return int(new["metadata"]["resourceVersion"]) < int(cached["metadata"]["resourceVersion"])
    except (KeyError, TypeError, ValueError):
        return False
