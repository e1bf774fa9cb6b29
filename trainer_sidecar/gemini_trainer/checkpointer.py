"""The few lines a training script adds: ``restore()`` at start, ``snapshot(step)`` per iteration.

``snapshot(step)`` blocks only for the copy of this rank's state into the free shared-memory
slot (gemini.slots); the checksum, the commit (header written last), the heartbeat and
the notice to the sidecar run on a background thread. The free slot is reused only once the
newest version is on every holder (the sidecar acknowledges it in the slot file): all ranks
decide together with one integer all-reduce (MIN, on a gloo group of their own) and skip the
snapshot together while some rank's newest version is still on its way, so the newest version
that every holder has is never overwritten, and the interval stretches by itself while
replication lags. A sidecar that is missing or failing is
recorded in ``errors`` and never stops training. ``step`` is the number of completed
iterations, which is also the version and the step ``restore()`` returns: resume with
``for step in range(restore() or 0, total)``.

``restore()`` follows the launcher's instructions (environment, see ``RestoreInstruction``):
no version means a fresh start (None); a version number means exactly that version, which must
be complete in shared memory (the sidecar places peer or S3 copies there before the restart;
restore waits up to GEMINI_RESTORE_TIMEOUT_S for it); ``latest`` means the newest version that
is complete on every rank (agreed with an all-gather when torch.distributed is up).

Several processes per node (LOCAL_WORLD_SIZE > 1, as the launcher starts them for
numProcPerNode > 1) write regions of one slot file per node (gemini_trainer.node_shard): the
sidecar sees the node's checkpoint as one shard, and only local rank 0 commits and notifies it.

Environment: GEMINI_SHM_DIR, GEMINI_JOB, RANK/WORLD_SIZE (or GEMINI_RANK/GEMINI_WORLD_SIZE),
LOCAL_RANK/LOCAL_WORLD_SIZE and NODE_RANK (or GEMINI_RANK) with several processes per node,
GEMINI_SHM_CAPACITY_BYTES (slot size; default: first snapshot's size plus headroom),
GEMINI_SIDECAR_URL, GEMINI_AUTH_TOKEN, GEMINI_HEARTBEAT_FILE, GEMINI_RESTORE_VERSION,
GEMINI_RESTORE_SOURCE, GEMINI_RESTORE_TIMEOUT_S, GEMINI_RESTART_EPOCH (read by
gemini_trainer.checkpointer_config). The copy into the slot is gemini_trainer.snapshot_copy's,
the restore path gemini_trainer.restorer's.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import weakref
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from gemini.control.client import ControlClient
from gemini.control.messages import NotifyRequest
from gemini.control.paths import COMMITTED_PATH
from gemini.slots.layout import SLOT_HEADROOM_BYTES, SlotError, SlotInfo, shard_path
from gemini.slots.shard import ShardSlots
from gemini_trainer import timeline
from gemini_trainer.capture import (
    StateAdapter,
    Tree,
    adapter_for,
    capture_rng,
    dtype_label,
    encode_tree,
)
from gemini_trainer.checkpointer_config import (
    CheckpointerConfig,
    RestoreError,
    RestoreInstruction,
    check_budget,
)
from gemini_trainer.commprof import CommRecorder, phase_path, profile_path
from gemini_trainer.device_copy import DeviceCopier
from gemini_trainer.node_shard import RegionWriter, SoleWriter
from gemini_trainer.payload import (
    TensorEntry,
    encode_index,
    payload_size,
    plan_layout,
    write_index,
)
from gemini_trainer.restorer import Restorer
from gemini_trainer.snapshot_copy import CopyMethod, copy_all

# The settings the Checkpointer takes, importable from here as they always were.
__all__ = ["Checkpointer", "CheckpointerConfig", "RestoreError", "RestoreInstruction",
           "SnapshotStats", "close_all"]

log = logging.getLogger(__name__)

SIDECAR_NOTIFY_PATH = COMMITTED_PATH
NOTIFY_TIMEOUT_SECONDS = 2.0
HEADROOM_BYTES = SLOT_HEADROOM_BYTES  # room for the user's extra state to grow


@dataclass(frozen=True)
class SnapshotStats:
    step: int
    nbytes: int
    stall_s: float  # what the training step waited for: capture + copy (+ previous commit)
    waited_s: float  # part of the stall spent waiting for the previous commit to finish
    skipped: bool = False  # the ranks agreed to keep their older slot this time


class Checkpointer:
    """Per-iteration in-memory checkpoints of one rank (see the module docstring)."""

    def __init__(
        self,
        target: Any,
        optimizer: Any = None,
        lr_scheduler: Any = None,
        *,
        config: CheckpointerConfig | None = None,
        adapter: StateAdapter | None = None,
    ) -> None:
        self.config = config or CheckpointerConfig.from_env()
        self.adapter = adapter or adapter_for(target, optimizer, lr_scheduler)
        self.path = shard_path(self.config.node, self.config.shm_dir, self.config.job)
        self._restorer = Restorer(self.config, self.adapter, self.path, self._open_slots)
        self.errors: deque[str] = deque(maxlen=100)  # background failures, newest last
        self.last: SnapshotStats | None = None
        self._slots: ShardSlots | None = None
        self._layout: tuple[tuple[tuple[int, ...], ...], list[int], int] | None = None
        self._writer = self._make_writer()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gemini-commit")
        self._pending: Future[None] | None = None
        self._lock = threading.Lock()
        self.recorder = self._make_recorder()
        self.copy_method = CopyMethod()
        self.skipped_snapshots = 0
        self._agreement: Any = None  # the gloo process group of the write decision
        self._device: DeviceCopier | None = None  # CUDA state: copies off the critical path
        _live.add(self)
        timeline.mark("built (process group, model, engine)")
        self._first_step_marked = False  # the timeline's last line, once per Checkpointer

    def _make_recorder(self) -> CommRecorder | None:
        cfg = self.config
        if (cfg.profile_iterations <= 0 or cfg.local_rank != 0
                or not torch.distributed.is_initialized()):
            return None  # one profile per node: the sidecar paces the node's traffic
        cfg.shm_dir.mkdir(parents=True, exist_ok=True)
        return CommRecorder(
            profile_path(cfg.shm_dir, cfg.node, cfg.job),
            cfg.profile_iterations,
            phase_path(cfg.shm_dir, cfg.node, cfg.job),
        ).install()

    def _make_writer(self) -> SoleWriter | RegionWriter:
        cfg = self.config
        if cfg.local_world_size == 1:
            return SoleWriter(self._slots_for)
        return RegionWriter(self._slots_for, self._gather_local, cfg.local_rank,
                            cfg.local_world_size)

    def _gather_local(self, nbytes: int, token: int) -> list[tuple[int, int]]:
        """Every local process's (payload bytes, token), from an all-gather over all ranks
        (ranks are numbered node by node)."""
        group = self._agreement_group()
        if group is None:
            raise SlotError("several training processes per node need torch.distributed "
                            "initialised before the first snapshot")
        mine = torch.tensor([nbytes, token], dtype=torch.int64)
        everyone = [torch.zeros_like(mine) for _ in range(torch.distributed.get_world_size())]
        torch.distributed.all_gather(everyone, mine, group=group)
        first = self.config.node * self.config.local_world_size
        return [(int(t[0]), int(t[1]))
                for t in everyone[first : first + self.config.local_world_size]]

    # -- snapshot ----------------------------------------------------------------------------

    def snapshot(self, step: int, extra: Tree = None) -> SnapshotStats:
        """Copy this rank's state as version ``step``; commit and notify in the background."""
        if self.recorder is not None:
            self.recorder.iteration_end()
        if not self._first_step_marked:  # one attribute read per iteration after the first
            self._first_step_marked = True
            timeline.mark("first step done")
        start = time.perf_counter()
        waited = self._wait_pending()
        if not self._agree_to_write():
            self.skipped_snapshots += 1
            if self.recorder is not None:
                self.recorder.iteration_start()
            return SnapshotStats(step, 0, time.perf_counter() - start, waited, skipped=True)
        tree = {
            "kind": self.adapter.kind,
            "step": step,
            "rank": self.config.rank,
            "world_size": self.config.world_size,
            "state": self.adapter.capture(),
            "rng": capture_rng(),
            "extra": extra,
        }
        skeleton, tensors = encode_tree(tree)
        offsets, data_end = self._plan(tensors)
        entries = [
            TensorEntry(f"t{i}", dtype_label(t), tuple(t.shape), off, t.nbytes)
            for i, (t, off) in enumerate(zip(tensors, offsets, strict=True))
        ]
        index = encode_index(entries, skeleton)
        nbytes = payload_size(data_end, index)
        buf = self._writer.begin(step, nbytes)
        use_numpy = self.copy_method.next()
        copy_start = time.perf_counter()
        try:
            copy_all(buf, tensors, offsets, use_numpy, self._device)
            write_index(buf, data_end, index)
        except BaseException:
            if self._device is not None:
                self._device.finish()  # nothing may still write into the slot given up
            self._writer.abort()
            raise
        del buf
        self.copy_method.record(use_numpy, time.perf_counter() - copy_start, nbytes)
        stats = SnapshotStats(step, nbytes, time.perf_counter() - start, waited)
        self.last = stats
        self._pending = self._pool.submit(self._commit, step, stats.stall_s)
        if self.recorder is not None:
            self.recorder.iteration_start()
        return stats

    def _agree_to_write(self) -> bool:
        """Whether every rank may reuse its older slot now (see the module docstring)."""
        if not self.config.sidecar_url:  # nothing replicates (on any rank): nothing to agree
            return True
        mine = self._may_overwrite()
        group = self._agreement_group()
        if group is None:
            return mine
        flag = torch.tensor([int(mine)], dtype=torch.int32)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN, group=group)
        return bool(flag.item())

    def _may_overwrite(self) -> bool:
        if self._slots is None and self.path.exists():
            self._slots = ShardSlots(self.path)
        if self._slots is None:
            return True
        return self._slots.may_overwrite(
            max(self._slots.acknowledged_seq, self._restorer.restored_seq))

    def _agreement_group(self) -> Any:
        dist = torch.distributed
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return None
        if self._agreement is None:  # every rank gets here at its first snapshot
            self._agreement = dist.new_group(backend="gloo")
        return self._agreement

    def _plan(self, tensors: list[torch.Tensor]) -> tuple[list[int], int]:
        # Tensor shapes do not change between iterations: plan the offsets once.
        shapes = tuple((t.nbytes, *t.shape) for t in tensors)
        if self._layout is None or self._layout[0] != shapes:
            offsets, end = plan_layout([t.nbytes for t in tensors])
            self._layout = (shapes, offsets, end)
            if self._device is None and DeviceCopier.wanted(tensors):  # decided once, here
                self._device = DeviceCopier()
                self._device.install()
        return self._layout[1], self._layout[2]

    def _slots_for(self, nbytes: int, create: bool = True) -> ShardSlots:
        if self._slots is None:
            self.config.shm_dir.mkdir(parents=True, exist_ok=True)
            if self.path.exists() or not create:
                self._slots = ShardSlots(self.path)
            else:
                capacity = self.config.capacity_bytes or nbytes + HEADROOM_BYTES
                check_budget(self.config, capacity)
                self._slots = ShardSlots(self.path, capacity, rank=self.config.node)
        if nbytes > self._slots.capacity:
            whose = ("this rank's state" if self.config.local_world_size == 1 else
                     f"the state of this node's {self.config.local_world_size} processes")
            raise SlotError(
                f"{whose} is {nbytes} bytes but {self.path} holds {self._slots.capacity}"
                " per slot; remove the file or set GEMINI_SHM_CAPACITY_BYTES larger"
            )
        return self._slots

    def _wait_pending(self) -> float:
        if self._pending is None:
            return 0.0
        start = time.perf_counter()
        self._pending.result()
        self._pending = None
        return time.perf_counter() - start

    def _commit(self, step: int, stall_s: float) -> None:
        try:
            if self._device is not None:
                self._device.finish()  # the bytes are in the slot before it is checksummed
            info = self._writer.commit(step)
        except Exception as err:  # recorded, never raised into the training loop
            self._record(f"commit of step {step} failed: {err}")
            self._writer.abort()
            return
        if info is None:
            return  # another process of this node commits the node's version
        self.heartbeat(step)
        if self.config.sidecar_url:
            self._notify(info, stall_s)

    def _notify(self, info: SlotInfo, stall_s: float) -> None:
        url = self.config.sidecar_url or ""
        request = NotifyRequest(
            version=info.version, stall_seconds=stall_s, rank=self.config.node, seq=info.seq,
            slot=info.index, bytes=info.payload_len, checksum=info.checksum, path=str(self.path),
        )
        try:
            ControlClient.for_url(url, self.config.auth_token, NOTIFY_TIMEOUT_SECONDS).notify(
                request)
        except Exception as err:  # a missing sidecar must not stop training
            self._record(f"notifying the sidecar at {url.rstrip('/') + SIDECAR_NOTIFY_PATH} "
                         f"of step {info.version} failed: {err}")

    def _record(self, message: str) -> None:
        with self._lock:
            if not self.errors:
                log.warning("%s (further errors are kept in Checkpointer.errors)", message)
            self.errors.append(message)

    def heartbeat(self, step: int) -> None:
        """Tell the launcher that training progresses (file content: step and unix time)."""
        path = self.config.heartbeat_file
        if path is None:
            return
        try:
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text(f"{step} {time.time():.6f}\n")
            os.replace(tmp, path)
        except OSError as err:
            self._record(f"heartbeat file {path} not writable: {err}")

    def flush(self) -> None:
        """Wait until the last snapshot is committed (e.g. before a planned exit)."""
        self._wait_pending()

    def close(self) -> None:
        if self not in _live:
            return  # closed already
        _live.discard(self)
        self.flush()
        self._pool.shutdown(wait=True)
        if self._device is not None:
            self._device.close()
            self._device = None
        if self.recorder is not None:
            self.recorder.close()
        if self._slots is not None:
            with contextlib.suppress(BufferError):  # a view is still held; unmapped at exit
                self._slots.close()
            self._slots = None

    # -- restore (gemini_trainer.restorer) ----------------------------------------------------

    @property
    def extra_state(self) -> Tree:
        """The user's extra state, after restore()."""
        return self._restorer.extra_state

    @extra_state.setter
    def extra_state(self, value: Tree) -> None:
        self._restorer.extra_state = value

    def restore(self, instruction: RestoreInstruction | None = None) -> int | None:
        """Load the designated version; returns its step, or None for a fresh start."""
        step = self._restorer.restore(instruction or RestoreInstruction.from_env())
        if step is not None and self.recorder is not None:
            self.recorder.iteration_start()
        return step

    def _open_slots(self) -> ShardSlots:
        """The existing slot file, opened once (restore reads what the sidecar placed)."""
        if self._slots is None:
            self._slots = ShardSlots(self.path)
        return self._slots


_live: weakref.WeakSet[Checkpointer] = weakref.WeakSet()


def close_all() -> None:
    """Close every Checkpointer of this process (an in-process restart drops a failed
    attempt's; their slots' write locks would refuse the next attempt's)."""
    for ckpt in list(_live):
        try:
            ckpt.close()
        except Exception as err:  # the next attempt opens its own
            log.warning("closing a checkpointer of the failed attempt: %s", err)
            _live.discard(ckpt)
