"""One sidecar's S3 checkpoints (POST /persist, /commit, /restore, GET /committed-steps): the
own shard uploaded (resumable, gemini_sidecar.uploads) and downloaded, the commit marker and
retention (gemini_sidecar.s3), all under this job's identity."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from gemini.control.transfers import (
    CommitAnswer,
    CommittedStepsAnswer,
    PersistAnswer,
    RestoreAnswer,
)
from gemini.slots.layout import SlotInfo
from gemini_sidecar import s3 as s3mod
from gemini_sidecar import uploads
from gemini_sidecar.config import SidecarConfig
from gemini_sidecar.local import LocalShard, LocalShardError
from gemini_sidecar.metrics import SidecarMetrics
from gemini_sidecar.transfers import Progress

log = logging.getLogger(__name__)
T = TypeVar("T")
UPLOAD_STOP_S = 10.0  # for the parts in flight of a stopping upload (64 MiB each by default)


def s3_identity(cfg: SidecarConfig) -> s3mod.JobIdentity:
    """Whose S3 checkpoints this sidecar writes and reads (see gemini_sidecar.s3)."""
    return s3mod.JobIdentity(cfg.namespace, cfg.job, cfg.job_uid or s3mod.NO_UID)


class S3Checkpoints:
    """The own shard's versions in S3. ``s3``: the store (None: S3 is not configured, and
    every call says so)."""

    def __init__(self, cfg: SidecarConfig, local: LocalShard, metrics: SidecarMetrics) -> None:
        self.cfg = cfg
        self._local, self._metrics = local, metrics
        self.s3 = s3mod.open_store(cfg.s3) if cfg.s3 else None
        self.identity = s3_identity(cfg)
        self._refused_steps: set[tuple[int, str]] = set()
        # the last upload that finished: (version, slot seq, CRC-32) and its answer
        self._persisted: tuple[tuple[int, int, int], PersistAnswer] | None = None
        # Set by stop(): uploads start no new part. Their threads are awaited by the event
        # loop's shutdown, so a long upload would keep a finished pod alive until SIGKILL.
        self._stopping = threading.Event()
        self._uploading: set[asyncio.Future[Any]] = set()
        if self.s3 is not None and not cfg.job_uid:
            log.warning("GEMINI_JOB_UID is unset: S3 checkpoints of job %s go under uid %s, "
                        "shared with any other job of that namespace and name started so",
                        cfg.job, s3mod.NO_UID)

    async def stop(self) -> bool:
        """Let the uploads end after their parts in flight, for a while; False: one did not
        (it may still read the slot file's mapping)."""
        self._stopping.set()
        if self._uploading:  # each ends after its parts in flight
            await asyncio.wait(set(self._uploading), timeout=UPLOAD_STOP_S)
        if self._uploading:
            log.warning("stopping with an S3 upload whose parts in flight did not end within "
                        "%.0f s; it is resumed by a later persist of that version",
                        UPLOAD_STOP_S)
            return False
        return True

    def notified(self, version: int) -> None:
        """The trainer committed `version`: an upload of it or a newer one is history (a
        restart from an older step writes those versions again)."""
        if self._persisted is not None and version <= self._persisted[0][0]:
            self._persisted = None

    def _need_s3(self) -> s3mod.S3Store:
        if self.s3 is None:
            raise ValueError("S3 is not configured: set GEMINI_S3_BUCKET (and endpoint/keys)")
        return self.s3

    async def persist(self, version: int | None, progress: Progress | None = None
                      ) -> PersistAnswer:
        """Upload a version of the own shard, resuming an unfinished upload of it
        (gemini_sidecar.uploads). The version is pinned in the slot file only while it is
        copied aside (stage_copy): the trainers go on checkpointing into both slots during the
        upload. A version uploaded last is answered from the note of that upload (a retry
        after the answer was lost)."""
        store = self._need_s3()
        progress = progress if progress is not None else Progress()
        try:
            info, data = self._local.read(version)
        except LocalShardError:
            # Asked again after the trainers reused its slot (ranks' uploads can end a minute
            # apart on a slow S3, longer than a finished transfer answers for itself).
            earlier = self._upload_of_reused_slot(version)
            if earlier is None:
                raise
            return earlier
        done = self._persisted
        # the same slot write (a restart from an older step writes its versions again)
        if done is not None and done[0] == (info.version, info.seq, info.checksum):
            return done[1]
        progress.expect(len(data))
        started = time.perf_counter()
        key = await self._persist_slot(store, info, data, progress)
        seconds = time.perf_counter() - started
        self._metrics.s3_persist_seconds.observe(seconds)
        answer = PersistAnswer(key, info.version, len(data), seconds, info.checksum)
        self._persisted = ((info.version, info.seq, info.checksum), answer)
        return answer

    async def _persist_slot(self, store: s3mod.S3Store, info: SlotInfo, data: memoryview,
                            progress: Progress) -> str:
        """Upload the slot `info` describes, pinned while it is copied aside (or, without
        memory for a copy, for the whole upload); the object's key."""
        if not self._local.pin(info):
            raise ValueError(f"version {info.version} was overwritten before its upload began; "
                             "persist a newer version")
        pinned = True
        try:
            staged = await asyncio.to_thread(uploads.stage_copy, data)
            if staged is not None:  # else no memory for a copy: upload from the pinned slot
                if not self._local.still_valid(info):
                    raise ValueError(f"version {info.version} was overwritten while it was "
                                     "copied for its upload; persist a newer version")
                data, pinned = staged, False
                self._local.unpin(info)
            sent = await self._upload(store, info, data, progress)
        except Exception:
            self._metrics.s3_failures.inc()
            raise
        finally:
            if pinned:
                self._local.unpin(info)
        self._metrics.s3_parts_sent.inc(sent.sent)
        if pinned and not self._local.still_valid(info):
            self._metrics.s3_failures.inc()
            raise ValueError(f"version {info.version} was overwritten during the upload; "
                             "persist a newer version")
        return sent.key

    async def _upload(self, store: s3mod.S3Store, info: SlotInfo, data: memoryview,
                      progress: Progress) -> uploads.Uploaded:
        """The upload on a daemon thread that stop() ends and waits for, for a while: a part
        S3 never answers must not keep the process from exiting (the event loop's shutdown
        joins its executor's threads, the interpreter every pool's)."""
        future = in_daemon_thread(functools.partial(
            s3mod.persist_pinned, store, self.identity, info.version, self.cfg.rank, data,
            info.checksum, info.seq, self._upload_state_path(), progress.add, self._stopping))
        self._uploading.add(future)
        future.add_done_callback(_forget(self._uploading))
        return await asyncio.shield(future)  # a cancelled request leaves the upload to stop()

    def _upload_of_reused_slot(self, version: int | None) -> PersistAnswer | None:
        """The last upload's answer if it was of `version` and the slot file holds only
        versions written after it, each newer: no restart from an older step rewrote
        `version` since (notified() forgets the upload when one does)."""
        if self._persisted is None or self._persisted[0][0] != version:
            return None
        (_, seq, _), answer = self._persisted
        complete = [i for i in self._local.slot_info() if i.complete]
        newer = bool(complete) and all(i.version > version and i.seq > seq for i in complete)
        return answer if newer else None

    def _upload_state_path(self) -> Path:
        # On the pod's memory volume, next to the slot file: it outlives a sidecar restart.
        return self._local.path.with_name(self._local.path.name + ".upload.json")

    async def commit(self, version: int) -> CommitAnswer:
        store = self._need_s3()
        retain = self.cfg.s3.retain if self.cfg.s3 else 3
        key = await asyncio.to_thread(
            s3mod.commit_checkpoint, store, self.identity, version, self.cfg.world_size
        )
        deleted = await asyncio.to_thread(s3mod.apply_retention, store, self.identity, retain)
        return CommitAnswer(key, version, tuple(deleted))

    async def committed_steps(self) -> CommittedStepsAnswer:
        """The steps committed to S3 by this job (its namespace, name and uid)."""
        refused: dict[int, str] = {}
        steps = await asyncio.to_thread(s3mod.committed_steps, self._need_s3(), self.identity,
                                        refused)
        for version, reason in sorted(refused.items()):
            self._refuse_step(version, f"step {version} is not listed as committed: {reason}")
        return CommittedStepsAnswer(tuple(steps))

    async def restore(self, version: int | None, progress: Progress | None = None
                      ) -> RestoreAnswer:
        """Download this rank's object of a committed step of this job into local shm."""
        store = self._need_s3()
        progress = progress if progress is not None else Progress()
        if version is None:
            version = await asyncio.to_thread(s3mod.latest_committed, store, self.identity)
            if version is None:
                raise ValueError(f"no committed checkpoint of job {self.identity} in S3")
        length, crc = await self._own_object(store, version)
        progress.expect(length)
        slots, view = self._local.begin_write(version, length)
        started = time.perf_counter()
        try:
            await asyncio.to_thread(
                s3mod.download_shard, store, self.identity, version, self.cfg.rank, view, crc,
                progress.add)
        except BaseException:
            self._metrics.s3_failures.inc()
            slots.abort()
            raise
        slots.commit(version, crc)
        seconds = time.perf_counter() - started
        self._metrics.s3_restore_seconds.observe(seconds)
        return RestoreAnswer(version, length, seconds)

    async def _own_object(self, store: s3mod.S3Store, version: int) -> tuple[int, int]:
        """This rank's object of committed step `version`: its length and CRC-32, from the
        commit marker (ForeignCheckpoint: the marker names another job)."""
        marker = await asyncio.to_thread(s3mod.read_marker, store, self.identity, version)
        try:
            s3mod.check_marker(marker, self.identity, version, self.cfg.world_size)
        except s3mod.ForeignCheckpoint as err:
            self._refuse_step(version, str(err))
            raise
        entry = marker["ranks"][str(self.cfg.rank)]
        return int(entry["bytes"]), int(entry["crc32"])

    def _refuse_step(self, version: int, reason: str) -> None:
        """Log a refused S3 step once (a caller retrying must not flood the log)."""
        if (version, reason) not in self._refused_steps:
            self._refused_steps.add((version, reason))
            log.warning("S3 of job %s: %s", self.identity, reason)


def in_daemon_thread(call: Callable[[], T]) -> asyncio.Future[T]:
    """`call()` on a daemon thread of its own, as a future of the running loop."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(outcome: Callable[[], None]) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
            loop.call_soon_threadsafe(outcome)

    def finish(result: Any, error: BaseException | None) -> None:
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    def run() -> None:
        try:
            result, error = call(), None
        except BaseException as err:  # handed to the awaiting coroutine
            result, error = None, err
        settle(functools.partial(finish, result, error))

    threading.Thread(target=run, name="gemini-s3-upload", daemon=True).start()
    return future


def _forget(running: set[asyncio.Future[Any]]) -> Callable[[asyncio.Future[Any]], None]:
    def done(future: asyncio.Future[Any]) -> None:
        running.discard(future)
        if not future.cancelled():
            future.exception()  # read here: its request may have gone (no unread-error log)
    return done
