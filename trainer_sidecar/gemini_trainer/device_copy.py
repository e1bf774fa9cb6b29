"""CUDA snapshots off the critical path: device-to-host copies that overlap the next iteration.

A snapshot of a GPU-resident shard would otherwise be a blocking ``copy_`` into pageable
shared memory in every iteration (seconds for a 10 GB shard). Here:

- the slot file's mapping is page-locked once (``cudaHostRegister``), so copies go at the
  pinned device-to-host rate straight into shared memory, with no staging copy;
- the copies are issued in chunks on a dedicated CUDA stream, ordered after the work the
  training's current stream has queued so far (an event), and the snapshot returns at once;
- the training waits only where it would change what is being copied: a global optimizer
  step pre-hook makes the stream of the next optimizer step wait for the copy's event (on the
  device: the host does not block, and normally the copy ended during forward and backward).
  Tensors the optimizers do not own (module buffers, which a forward may change) are copied
  at once, on the current stream, as before;
- the commit thread waits for the copy's event before it checksums and commits the slot.

Only used when CUDA is available and a captured tensor lives on a CUDA device; the CPU path is
unchanged. No GPU has run this module yet (see the README's known gaps).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

log = logging.getLogger(__name__)

_cuda: Any = torch.cuda  # its Stream, Event and cudart are untyped
CHUNK_BYTES = 64 << 20  # per copy call: the copy engine interleaves with compute kernels


class DeviceCopier:
    """Asynchronous device-to-host copies of one Checkpointer's snapshots."""

    def __init__(self) -> None:
        self._stream: Any = None
        self._done: Any = None  # torch.cuda.Event of the copy in flight
        self._keep: list[torch.Tensor] = []  # sources alive until the copy ends
        self._registered: set[tuple[int, int]] = set()
        self._optimizers: list[Any] = []  # seen by the step hook: whose tensors may change
        self._hook: Any = None
        self._owned: set[int] = set()
        self._owned_for: tuple[int, ...] | None = None  # state entries per optimizer, then

    @staticmethod
    def wanted(tensors: Sequence[torch.Tensor]) -> bool:
        return torch.cuda.is_available() and any(t.is_cuda for t in tensors)

    def install(self) -> None:
        if self._hook is None:
            self._hook = torch.optim.optimizer.register_optimizer_step_pre_hook(self._before_step)

    def _before_step(self, optimizer: Any, *_: Any) -> None:
        if optimizer not in self._optimizers:
            self._optimizers.append(optimizer)
        if self._done is not None:  # the device waits; the host goes on queueing work
            torch.cuda.current_stream().wait_event(self._done)

    def register(self, array: np.ndarray) -> None:
        """Page-lock the slot mapping once (a failure leaves it pageable: slower, correct)."""
        key = (int(array.ctypes.data), int(array.nbytes))
        if key in self._registered:
            return
        err = _cuda.cudart().cudaHostRegister(key[0], key[1], 0)
        if int(err) != 0:
            log.warning("cudaHostRegister of %d bytes of the slot file failed (%s): snapshots "
                        "copy into pageable memory", key[1], err)
        self._registered.add(key)

    def owned_by_optimizers(self) -> set[int]:
        """Storages of the tensors the optimizers seen so far update at their step; walked
        again only when an optimizer or its state entries appeared (once, after the first
        steps), not every iteration."""
        shape = tuple(len(opt.state) for opt in self._optimizers)
        if shape != self._owned_for:
            self._owned, self._owned_for = self._walk_optimizers(), shape
        return self._owned

    def _walk_optimizers(self) -> set[int]:
        owned: set[int] = set()
        for opt in self._optimizers:
            for group in opt.param_groups:
                owned.update(p.untyped_storage().data_ptr() for p in group["params"])
            for state in opt.state.values():
                owned.update(v.untyped_storage().data_ptr() for v in state.values()
                             if isinstance(v, torch.Tensor))
        return owned

    def copy(self, pairs: Sequence[tuple[np.ndarray, torch.Tensor]]) -> None:
        """Queue the copies of ``pairs`` (destination view, CUDA source); returns at once."""
        if self._stream is None:
            self._stream = _cuda.Stream()
        ready = _cuda.Event()
        ready.record()  # after what the training stream has queued: this step's updates
        self._stream.wait_event(ready)
        with torch.cuda.stream(self._stream):
            for dst, src in pairs:
                flat_src = src.detach().reshape(-1).view(torch.uint8)
                flat_dst = torch.from_numpy(dst)
                for start in range(0, flat_src.numel(), CHUNK_BYTES):
                    end = min(start + CHUNK_BYTES, flat_src.numel())
                    flat_dst[start:end].copy_(flat_src[start:end], non_blocking=True)
                src.record_stream(self._stream)  # its memory is not reused before the copy
                self._keep.append(src)
        self._done = _cuda.Event()
        self._done.record(self._stream)

    def finish(self) -> None:
        """Wait (on the host) until the queued copies are in memory."""
        if self._done is not None:
            self._done.synchronize()
        self._keep.clear()

    def close(self) -> None:
        self.finish()
        self._done = None
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        for ptr, _ in self._registered:
            _cuda.cudart().cudaHostUnregister(ptr)
        self._registered.clear()
