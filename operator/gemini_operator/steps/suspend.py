"""Saving the checkpoint in memory before a suspended job's pods are deleted: persist and
commit the newest step every rank holds complete, so that resume loses nothing. Bounded (the
pods are deleted afterwards whatever happened); events say what was kept and what lost."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime

from gemini_operator.calls.poller import complete_in_memory
from gemini_operator.calls.sidecars import SidecarError, persist_and_commit
from gemini_operator.calls.worker_calls import WorkerCalls
from gemini_operator.cluster.cache import Snapshot
from gemini_operator.core.actions import SaveBeforeSuspend
from gemini_operator.core.apitime import api_time
from gemini_operator.core.events import Event, EventReason
from gemini_operator.core.outcome import Outcome
from gemini_operator.core.status import JobStatus
from gemini_operator.core.status_changes import PersistedBeforeSuspend, StatusWriter
from gemini_operator.core.types import JobView

SUSPEND_PERSIST_SECONDS = 120.0  # how long a suspend waits for the upload before deleting


class SuspendSaver:
    def __init__(self, calls: WorkerCalls,
                 clock: Callable[[], datetime] = lambda: datetime.now(UTC)) -> None:
        self.calls, self._clock = calls, clock

    def save_before_suspend(self, job: JobView, snap: Snapshot, action: SaveBeforeSuspend,
                            status: JobStatus, writer: StatusWriter) -> Outcome:
        pods = {r: p for r, p in self.calls.cached(snap, status.restart_attempt).items()
                if p.ip and not p.deleting and not p.terminal}
        in_memory = status.checkpoint.in_memory_step
        persisted = status.checkpoint.persisted_step
        if action.spec.persistence is None:
            return Outcome(events=[Event.of(EventReason.SUSPENDED_WITHOUT_CHECKPOINT, (
                f"persistence is not configured: the checkpoint in memory (step {in_memory}) "
                "goes with the pods and resume starts from step 0 (set spec.persistence to "
                "keep it)"))])
        kept = f"resume restores step {persisted}" if persisted is not None else (
            "resume starts from step 0")
        try:
            token = self.calls.token(job)
            inventories = self.calls.all_inventories(pods, token)
            # Every rank's shard, or the commit would name a step S3 does not fully hold.
            version = complete_in_memory(inventories, list(range(action.spec.num_nodes)))
            if version is None:
                return Outcome(events=[Event.of(EventReason.SUSPEND_CHECKPOINT_FAILED, (
                    f"no step is complete in every rank's memory: {kept}"))])
            if persisted is not None and version <= persisted:
                return Outcome(events=[Event.of(EventReason.SUSPEND_CHECKPOINT_SAVED, (
                    f"nothing newer than the committed step in memory: {kept}"))])
            persist_and_commit(self.calls.sidecars(pods), token, version,
                               SUSPEND_PERSIST_SECONDS)
        except (SidecarError, RuntimeError) as err:
            return Outcome(events=[Event.of(EventReason.SUSPEND_CHECKPOINT_FAILED, (
                f"could not persist the checkpoint in memory (step {in_memory}) before "
                f"deleting the pods: {err}; {kept}")[:1024])])
        writer.set(PersistedBeforeSuspend(version, api_time(self._clock())))
        return Outcome(events=[Event.of(
            EventReason.SUSPEND_CHECKPOINT_SAVED, f"persisted and committed step {version} "
            "before deleting the pods: resume restores it")])
