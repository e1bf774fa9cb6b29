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
GEMINI_RESTORE_SOURCE, GEMINI_RESTORE_TIMEOUT_S, GEMINI_RESTART_EPOCH.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gemini.control.client import ControlClient
from gemini.control.messages import NotifyRequest
from gemini.control.paths import COMMITTED_PATH
from gemini.slots.layout import SLOT_HEADROOM_BYTES, SlotBusy, SlotError, SlotInfo, shard_path
from gemini.slots.shard import ShardSlots
from gemini_trainer import timeline
from gemini_trainer.capture import (
    StateAdapter,
    Tree,
    adapter_for,
    capture_rng,
    decode_tree,
    dtype_label,
    encode_tree,
    owned,
    restore_rng,
    tensor_view,
)
from gemini_trainer.commprof import CommRecorder, phase_path, profile_path
from gemini_trainer.device_copy import DeviceCopier
from gemini_trainer.node_shard import RegionWriter, SoleWriter, region_payload
from gemini_trainer.payload import (
    TensorEntry,
    encode_index,
    payload_size,
    plan_layout,
    read_payload,
    write_index,
)

log = logging.getLogger(__name__)

SIDECAR_NOTIFY_PATH = COMMITTED_PATH
NOTIFY_TIMEOUT_SECONDS = 2.0
HEADROOM_BYTES = SLOT_HEADROOM_BYTES  # room for the user's extra state to grow


class RestoreError(Exception):
    """The designated version cannot be restored; the message says what is missing."""


@dataclass(frozen=True)
class RestoreInstruction:
    """What the launcher asked for: no version (fresh start), a version, or ``latest``."""

    version: int | None
    latest: bool = False
    source: str = "local"  # local | peer | s3: where the sidecar got it (for the record)
    epoch: int = 0  # GEMINI_RESTART_EPOCH
    timeout_s: float = 60.0

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> RestoreInstruction:
        env = os.environ if env is None else env
        raw = env.get("GEMINI_RESTORE_VERSION", "").strip().lower()
        source = env.get("GEMINI_RESTORE_SOURCE", "local") or "local"
        epoch = int(env.get("GEMINI_RESTART_EPOCH", "0") or 0)
        timeout = float(env.get("GEMINI_RESTORE_TIMEOUT_S", "60") or 60)
        if raw in ("", "none"):
            return cls(None, False, source, epoch, timeout)
        if raw == "latest":
            return cls(None, True, source, epoch, timeout)
        try:
            version = int(raw)
        except ValueError as err:
            raise RestoreError(
                f"GEMINI_RESTORE_VERSION={raw!r}: use a step number, 'latest' or 'none'"
            ) from err
        return cls(version, False, source, epoch, timeout)


@dataclass(frozen=True)
class CheckpointerConfig:
    rank: int
    world_size: int
    shm_dir: Path
    job: str = ""
    capacity_bytes: int | None = None  # None: first snapshot's size + HEADROOM_BYTES
    sidecar_url: str | None = None
    auth_token: str = field(default="", repr=False)
    heartbeat_file: Path | None = None
    profile_iterations: int = 20  # iterations of communication to profile; 0: none
    local_rank: int = 0
    local_world_size: int = 1  # training processes on this node, one slot file for all
    node_rank: int | None = None  # the slot file's (and sidecar's) rank; None: ``rank``
    memory_budget_bytes: int | None = None  # checkpoint memory per node (GeminiJob spec)
    replicas: int = 0  # m, copies of each node's checkpoint (0: unknown)

    def __post_init__(self) -> None:
        if self.local_world_size > 1 and self.rank != self.node * self.local_world_size + (
                self.local_rank):
            raise ValueError(
                f"rank {self.rank} is not node rank {self.node} x {self.local_world_size} local "
                f"processes + local rank {self.local_rank}: ranks must be numbered node by node"
            )

    @property
    def node(self) -> int:
        return self.rank if self.node_rank is None else self.node_rank

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> CheckpointerConfig:
        env = os.environ if env is None else env

        def pick(*names: str, default: str = "") -> str:
            return next((env[n] for n in names if env.get(n)), default)

        capacity = pick("GEMINI_SHM_CAPACITY_BYTES")
        heartbeat = pick("GEMINI_HEARTBEAT_FILE")
        local_world = int(pick("LOCAL_WORLD_SIZE", default="1"))
        if local_world > 1:  # the launcher's per-process ranks; GEMINI_RANK is the node's
            ranks: dict[str, Any] = {
                "rank": int(pick("RANK", default="0")),
                "world_size": int(pick("WORLD_SIZE", default="1")),
                "local_rank": int(pick("LOCAL_RANK", default="0")),
                "local_world_size": local_world,
                "node_rank": int(pick("GEMINI_RANK", "NODE_RANK", default="0")),
            }
        else:
            ranks = {"rank": int(pick("GEMINI_RANK", "RANK", default="0")),
                     "world_size": int(pick("GEMINI_WORLD_SIZE", "WORLD_SIZE", default="1"))}
        budget = pick("GEMINI_MEMORY_BUDGET_BYTES")
        return cls(
            **ranks,
            memory_budget_bytes=int(budget) if budget else None,
            replicas=int(pick("GEMINI_REPLICAS", default="0")),
            shm_dir=Path(pick("GEMINI_SHM_DIR", default="/dev/shm")),
            job=pick("GEMINI_JOB"),
            capacity_bytes=int(capacity) if capacity else None,
            sidecar_url=pick("GEMINI_SIDECAR_URL") or None,
            auth_token=pick("GEMINI_AUTH_TOKEN"),
            heartbeat_file=Path(heartbeat) if heartbeat else None,
            profile_iterations=int(pick("GEMINI_PROFILE_ITERATIONS", default="20")),
        )


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
        self.extra_state: Tree = None  # the user's extra state, after restore()
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
        self._restored_seq = 0  # a restored version is on every holder by construction
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
            self._copy_all(buf, tensors, offsets, use_numpy)
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

    def _copy_all(self, buf: np.ndarray, tensors: list[torch.Tensor], offsets: list[int],
                  use_numpy: bool) -> None:
        """Copy every tensor into the slot; CUDA tensors the optimizers own go asynchronously
        (gemini_trainer.device_copy), the rest now."""
        if self._device is None:  # CPU state: the plain copies, nothing else per iteration
            for t, off in zip(tensors, offsets, strict=True):
                _copy_tensor(buf, off, t, use_numpy)
            return
        owned = self._device.owned_by_optimizers()
        deferred = []
        for t, off in zip(tensors, offsets, strict=True):
            if t.is_cuda and t.untyped_storage().data_ptr() in owned:
                deferred.append((buf[off : off + t.nbytes], t))
            else:
                _copy_tensor(buf, off, t, use_numpy)
        if deferred:
            self._device.register(buf)
            self._device.copy(deferred)

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
        return self._slots.may_overwrite(max(self._slots.acknowledged_seq, self._restored_seq))

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

    # -- restore -----------------------------------------------------------------------------

    def restore(self, instruction: RestoreInstruction | None = None) -> int | None:
        """Load the designated version; returns its step, or None for a fresh start."""
        instr = instruction or RestoreInstruction.from_env()
        if instr.latest:
            version = self._agree_latest()
            if version is None:
                return None  # no version complete on every rank: a fresh start
        elif instr.version is None:
            return None
        else:
            version = instr.version
        slots = self._open_for_restore(instr)
        info = self._wait_for(slots, version, instr.timeout_s, instr.source)
        step = self._load(slots, info)
        self._restored_seq = info.seq
        log.info("restored step %d from %s (epoch %d)", step, instr.source, instr.epoch)
        timeline.mark(f"restored step {step}")
        if self.config.local_rank == 0:  # one process of the node cleans up
            self._drop_abandoned(slots, info.version)
        if self.recorder is not None:
            self.recorder.iteration_start()
        return step

    def _drop_abandoned(self, slots: ShardSlots, version: int) -> None:
        try:
            dropped = slots.drop_newer_than(version)
        except SlotBusy as err:  # the sidecar is writing the file (a fetch or an S3 restore)
            log.warning("versions newer than %d stay in %s: %s", version, self.path, err)
            return
        if dropped:
            log.info("dropped versions %s of the abandoned run from %s", dropped, self.path)

    def _open_for_restore(self, instr: RestoreInstruction) -> ShardSlots:
        deadline = time.monotonic() + instr.timeout_s
        while not self.path.exists():
            if time.monotonic() > deadline:
                raise RestoreError(
                    f"{self.path} does not exist after {instr.timeout_s:.0f}s: no checkpoint of "
                    f"rank {self.config.rank} in shared memory (source {instr.source}); has the "
                    "sidecar placed it? Check GEMINI_SHM_DIR and GEMINI_JOB"
                )
            time.sleep(0.05)
        if self._slots is None:
            self._slots = ShardSlots(self.path)
        return self._slots

    def _agree_latest(self) -> int | None:
        """The newest version complete here and on every other rank (all-gather), or None."""
        mine: list[int] = []
        if self.path.exists():
            if self._slots is None:
                self._slots = ShardSlots(self.path)
            mine = sorted(i.version for i in self._slots.slot_info() if i.complete)
        common = set(mine)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            everyone: list[Any] = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(everyone, mine)
            common = common.intersection(*[set(v) for v in everyone])
        return max(common) if common else None

    def _wait_for(self, slots: ShardSlots, version: int, timeout: float, source: str) -> SlotInfo:
        deadline = time.monotonic() + timeout
        while (info := slots.find(version)) is None:
            if time.monotonic() > deadline:
                held = [(i.version, i.state.name) for i in slots.slot_info()]
                raise RestoreError(
                    f"version {version} of rank {self.config.rank} is not complete in "
                    f"{self.path} after {timeout:.0f}s (slots hold {held}; source {source})"
                )
            time.sleep(0.05)
        return info

    def _load(self, slots: ShardSlots, info: SlotInfo) -> int:
        payload = self._own_payload(slots, info)
        try:
            entries, views, skeleton = read_payload(payload)
            tensors = [
                tensor_view(views[f"t{i}"], entries[f"t{i}"].dtype, entries[f"t{i}"].shape)
                for i in range(len(entries))
            ]
            tree = decode_tree(skeleton, tensors)
            self._check_identity(tree, info)
            self.adapter.load(tree["state"])
            self.extra_state = owned(tree["extra"])
            restore_rng(tree["rng"])
            step = int(tree["step"])
            del tree, tensors, views, entries
        finally:
            payload.release()
        if not slots.still_valid(info):
            raise RestoreError(
                f"version {info.version} in {self.path} was overwritten while it was being "
                "restored; only one writer may use the slots during a restore"
            )
        return step

    def _own_payload(self, slots: ShardSlots, info: SlotInfo) -> memoryview:
        """This process's payload, checked: the slot's, or its region of the node's."""
        local_world = self.config.local_world_size
        if local_world == 1:
            return slots.read(info.version, verify=True)
        node_payload = slots.read(info.version)
        try:
            return region_payload(node_payload, self.config.local_rank, local_world)
        except SlotError as err:
            raise RestoreError(f"version {info.version} in {self.path}: {err}") from err

    def _check_identity(self, tree: Tree, info: SlotInfo) -> None:
        want = (self.adapter.kind, self.config.rank, self.config.world_size)
        got = (tree["kind"], tree["rank"], tree["world_size"])
        if want != got:
            raise RestoreError(
                f"version {info.version} in {self.path} was written by (kind, rank, world size)"
                f" {got}, this trainer is {want}: the launcher pointed at the wrong shard"
            )


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


def check_budget(config: CheckpointerConfig, capacity: int) -> None:
    """Refuse, before the first snapshot is written, a node checkpoint the memory budget
    cannot hold: two versions in the node's slot file (the shared tmpfs is the budget's size),
    and two of each of the m-1 peers' checkpoints a sidecar holds."""
    budget = config.memory_budget_bytes
    if not budget:
        return
    copies = 2 * max(1, config.replicas - 1)
    if copies * capacity <= budget:
        return
    procs = config.local_world_size
    whose = ("this rank's checkpoint" if procs == 1 else
             f"this node's checkpoint ({procs} processes' shards, numProcPerNode)")
    raise SlotError(
        f"{whose} needs {capacity} bytes per version, so {copies} versions ({copies * capacity}"
        f" bytes: two in the slot file, and two of each of the m-1 = {max(0, config.replicas - 1)}"
        f" peers' a sidecar holds) but spec.checkpoint.memoryBudgetPerNode is {budget} bytes; "
        "raise it (and the sidecar's memory limit), or use fewer processes per node or replicas"
    )


def _copy_tensor(buf: np.ndarray, offset: int, tensor: torch.Tensor, use_numpy: bool) -> None:
    if tensor.nbytes == 0:
        return
    dst = buf[offset : offset + tensor.nbytes]
    if use_numpy and tensor.device.type == "cpu" and tensor.is_contiguous():
        np.copyto(dst, tensor.detach().reshape(-1).view(torch.uint8).numpy())
        return
    torch.from_numpy(dst).view(tensor.dtype).view(tensor.shape).copy_(tensor)


class CopyMethod:
    """Which CPU copy is faster here: torch's copy_ (parallel over the trainer's threads: 29
    GiB/s on 16 cores where one memcpy gives 5) or one numpy memcpy per tensor (no thread
    fork/join per tensor, faster on a few oversubscribed cores). The first snapshots try
    both in turn (CALIBRATION of each); the faster median per byte is used from then on."""

    CALIBRATION = 3

    def __init__(self) -> None:
        self.samples: dict[bool, list[float]] = {False: [], True: []}
        self.chosen: bool | None = None

    def next(self) -> bool:
        if self.chosen is not None:
            return self.chosen
        return len(self.samples[True]) < len(self.samples[False])

    def record(self, use_numpy: bool, seconds: float, nbytes: int) -> None:
        if self.chosen is not None or nbytes == 0:
            return
        self.samples[use_numpy].append(seconds / nbytes)
        if all(len(v) >= self.CALIBRATION for v in self.samples.values()):
            medians = {k: sorted(v)[len(v) // 2] for k, v in self.samples.items()}
            self.chosen = medians[True] < medians[False]
