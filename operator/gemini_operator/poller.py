"""What the operator learns from the sidecars and launchers of running jobs, every few seconds.

`CheckpointPoller.poll(key)` reads every sidecar's inventory (the newest step complete in
memory for every rank) and every launcher's progress (hang detection), and, when a job
persists to S3, has every sidecar upload that step and rank 0's sidecar commit it every
`persistence.intervalSeconds` or when the annotation `gemini.io/persist-requested` gets a new
value. It runs off the reconcile path (a lost node's sidecar may take seconds to time out);
its findings are kept in memory and handed to the pure reconcile, which writes the status, so
the two never overwrite each other. S3 failures leave training running and are retried.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from typing import Any

from gemini_operator import naming
from gemini_operator.cache import ClusterCache, JobKey
from gemini_operator.conditions import ConditionType, is_true
from gemini_operator.failures import Progress
from gemini_operator.kube import KubeClient
from gemini_operator.observed import PodView
from gemini_operator.reconcile import JobView, ReconcileConfig
from gemini_operator.sidecars import SidecarError, call, call_all
from gemini_operator.spec import JobSpec, Persistence, SpecError, parse_spec
from gemini_operator.status import CheckpointStatus, JobStatus

log = logging.getLogger(__name__)
POLL_SECONDS = 2.0
POLL_TIMEOUT_SECONDS = 2.0
PERSIST_TIMEOUT_SECONDS = 300.0
PERSIST_RETRY_SECONDS = 10.0
PERSIST_ANNOTATION = "gemini.io/persist-requested"


@dataclass(frozen=True)
class Findings:
    """The latest word from one job's workers."""

    checkpoint: CheckpointStatus
    progress: Progress | None = None


def complete_in_memory(inventories: Mapping[int, Mapping[str, Any]], ranks: Sequence[int]
                       ) -> int | None:
    """The newest version every rank holds complete in its own memory (None: no such one)."""
    common: set[int] | None = None
    for rank in ranks:
        doc = inventories.get(rank) or {}
        versions = {int(e["version"]) for e in doc.get("local") or () if e.get("complete")}
        common = versions if common is None else common & versions
    return max(common) if common else None


def progress_of(statuses: Mapping[int, Mapping[str, Any]], now: datetime,
                previous: Progress | None) -> Progress | None:
    """The job's newest step and since when it has been the newest (from launcher heartbeats)."""
    beats: list[Mapping[str, Any]] = [s["progress"] for s in statuses.values()
                                      if isinstance(s.get("progress"), dict)]
    if not beats:
        return previous
    step = max(int(b["step"]) for b in beats)
    if previous is not None and previous.step == step:
        return previous
    age = min(float(b.get("age_s", 0.0)) for b in beats if int(b["step"]) == step)
    return Progress(step, now - timedelta(seconds=age))


class CheckpointPoller:
    def __init__(self, kube: KubeClient, cache: ClusterCache, config: ReconcileConfig) -> None:
        self.kube, self.cache, self.config = kube, cache, config
        self._found: dict[JobKey, Findings] = {}
        self._handled_request: dict[JobKey, str] = {}
        self._persist_tried: dict[JobKey, float] = {}

    def findings(self, key: JobKey) -> Findings | None:
        return self._found.get(key)

    def forget(self, key: JobKey) -> None:
        self._found.pop(key, None)
        self._handled_request.pop(key, None)
        self._persist_tried.pop(key, None)

    def poll(self, key: JobKey) -> bool:
        """Refresh the findings of job `key`; True when they changed (reconcile it)."""
        snap = self.cache.snapshot(key)
        if snap is None:
            self.forget(key)
            return False
        job = JobView.from_object(snap.job)
        status = JobStatus.from_dict(job.status)
        launch = status.launch or {}
        if (not launch or int(launch.get("restartAttempt", -1)) != status.restart_attempt
                or is_true(status.conditions, ConditionType.RECOVERING) or status.recovery):
            return False
        try:
            spec = parse_spec(job.spec, self.config.default_sidecar_image)
        except SpecError:
            return False
        pods = {r: p for r, p in snap.pods.items() if p.owner_uid == job.uid
                and p.attempt == status.restart_attempt and p.ip and not p.deleting}
        if len(pods) < spec.num_nodes:
            return False
        token = self.kube.secret_value(job.namespace, naming.secret_name(job.name),
                                       naming.SECRET_TOKEN_KEY)
        if token is None:
            return False
        before = self._found.get(key)
        found = self._observe(key, job, status, pods, token, before)
        if spec.persistence is not None:
            found = self._persist(key, snap.job, spec, pods, token, found)
        self._found[key] = found
        return found != before

    def _observe(self, key: JobKey, job: JobView, status: JobStatus, pods: Mapping[int, PodView],
                 token: str, before: Findings | None) -> Findings:
        old = before.checkpoint if before is not None else status.checkpoint
        ports = self.config.render
        try:
            inventories = call_all({r: (p.ip, ports.sidecar_api_port) for r, p in pods.items()},
                                   "/inventory", token, {}, POLL_TIMEOUT_SECONDS)
            step = complete_in_memory(inventories, sorted(pods))
        except SidecarError as err:
            log.debug("inventory of %s/%s: %s", job.namespace, job.name, err)
            step = old.in_memory_step
        try:
            statuses = call_all({r: (p.ip, ports.launcher_port) for r, p in pods.items()},
                                "/status", token, {}, POLL_TIMEOUT_SECONDS)
            progress = progress_of(statuses, datetime.now(UTC),
                                   before.progress if before else None)
        except SidecarError:
            progress = before.progress if before else None
        checkpoint = replace(old, in_memory_step=step if step is not None else
                             old.in_memory_step)
        return Findings(checkpoint, progress)

    def _persist(self, key: JobKey, obj: Mapping[str, Any], spec: JobSpec,
                 pods: Mapping[int, PodView], token: str, found: Findings) -> Findings:
        persistence: Persistence = spec.persistence  # type: ignore[assignment]
        ckpt = found.checkpoint
        version = ckpt.in_memory_step
        request = ((obj.get("metadata") or {}).get("annotations") or {}).get(PERSIST_ANNOTATION)
        requested = bool(request) and self._handled_request.get(key) != request
        now = time.time()
        last = _unix(ckpt.persisted_time)
        due = requested or last is None or now - last >= persistence.interval_seconds
        if version is None or not due or (version == ckpt.persisted_step and not requested):
            return found
        if now - self._persist_tried.get(key, 0.0) < PERSIST_RETRY_SECONDS and not requested:
            return found
        self._persist_tried[key] = now
        ports = self.config.render
        try:
            bodies = {r: {"version": version} for r in pods}
            call_all({r: (p.ip, ports.sidecar_api_port) for r, p in pods.items()}, "/persist",
                     token, bodies, PERSIST_TIMEOUT_SECONDS)
            zero = pods[min(pods)]
            call(zero.ip, ports.sidecar_api_port, "/commit", token, {"version": version},
                 PERSIST_TIMEOUT_SECONDS)
        except SidecarError as err:
            log.warning("persisting step %s of %s/%s failed (retrying): %s", version, *key, err)
            return replace(found, checkpoint=replace(
                ckpt, persist_error=f"step {version}: {err}"[:1024]))
        if request:
            self._handled_request[key] = request
        stamp = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        log.info("persisted step %s of %s/%s to %s", version, *key, persistence.uri)
        return replace(found, checkpoint=replace(
            ckpt, persisted_step=version, persisted_time=stamp, persist_error=None,
            persist_request=request or ckpt.persist_request))


def _unix(text: str | None) -> float | None:
    if not text:
        return None
    return datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC).timestamp()
