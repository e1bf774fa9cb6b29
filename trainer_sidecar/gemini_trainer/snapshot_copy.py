"""How a snapshot copies the rank's tensors into the slot: ``copy_all`` (CUDA tensors the
optimizers own asynchronously, through gemini_trainer.device_copy; the rest at once) and
``CopyMethod``, which picks the faster CPU copy on this machine.
"""

from __future__ import annotations

import numpy as np
import torch

from gemini_trainer.device_copy import DeviceCopier


def copy_all(buf: np.ndarray, tensors: list[torch.Tensor], offsets: list[int], use_numpy: bool,
             device: DeviceCopier | None) -> None:
    """Copy every tensor into the slot; CUDA tensors the optimizers own go asynchronously
    (gemini_trainer.device_copy), the rest now."""
    if device is None:  # CPU state: the plain copies, nothing else per iteration
        for t, off in zip(tensors, offsets, strict=True):
            copy_tensor(buf, off, t, use_numpy)
        return
    owned = device.owned_by_optimizers()
    deferred = []
    for t, off in zip(tensors, offsets, strict=True):
        if t.is_cuda and t.untyped_storage().data_ptr() in owned:
            deferred.append((buf[off : off + t.nbytes], t))
        else:
            copy_tensor(buf, off, t, use_numpy)
    if deferred:
        device.register(buf)
        device.copy(deferred)


def copy_tensor(buf: np.ndarray, offset: int, tensor: torch.Tensor, use_numpy: bool) -> None:
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
