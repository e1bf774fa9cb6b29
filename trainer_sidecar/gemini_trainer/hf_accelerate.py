"""Hugging Face Accelerate loops: the batches from the restored step on.

    ckpt = Checkpointer(model, optimizer, scheduler)     # the objects accelerator.prepare returned
    start = ckpt.restore() or 0
    for step, batch in enumerate(resumed_batches(accelerator, loader, start, epochs), start):
        ...  # forward, accelerator.backward(loss), optimizer.step(), scheduler.step(), zero_grad
        ckpt.snapshot(step + 1)

``resumed_batches`` walks the epochs as a plain ``for epoch: for batch in loader`` loop does
(``set_epoch`` each epoch, so a shuffling sampler gives each epoch's order), starting inside the
epoch the restored step is in (``accelerator.skip_first_batches``). The restored RNG states are
put back where the uninterrupted loop had them: before the epoch's iterator is made when the
step ended an epoch, after the first batch is fetched otherwise (making an iterator draws a
seed; the batches skipped draw nothing). One batch per step: with gradient accumulation pass
``start * accumulation_steps``. A collate function that draws random numbers draws them again
for the first batch after a restore. A shuffling loader needs Accelerate's seedable sampler
(``DataLoaderConfiguration(use_seedable_sampler=True)``): otherwise it is refused, as each
epoch's order would come from a generator state that no restart can redo.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch.utils.data import RandomSampler

from gemini_trainer.capture import capture_rng, restore_rng

try:
    from accelerate.data_loader import SeedableRandomSampler
except ImportError as err:  # the `hf` extra
    raise ImportError(
        "gemini_trainer.hf_accelerate needs accelerate: pip install 'gemini-operator[hf]'"
    ) from err


def resumed_batches(accelerator: Any, loader: Any, start: int, epochs: int) -> Iterator[Any]:
    """The batches of ``epochs`` epochs of ``loader`` from batch number ``start`` on."""
    _refuse_unseeded_shuffle(loader)
    rng = capture_rng()  # as restore() left them (nothing has drawn since)
    per_epoch = len(loader)
    first = start // per_epoch
    for epoch in range(first, epochs):
        loader.set_epoch(epoch)
        skip = start - epoch * per_epoch if epoch == first else 0
        if not skip:
            yield from loader  # a fresh epoch: the RNG states are where the epoch began
            continue
        batches = iter(accelerator.skip_first_batches(loader, skip))
        batch = next(batches, None)
        restore_rng(rng)  # the uninterrupted loop had fetched this batch from its iterator
        if batch is not None:
            yield batch
            yield from batches


def _refuse_unseeded_shuffle(loader: Any) -> None:
    # A shuffling sampler that draws each epoch's order from a generator of its own (or from
    # the global RNG when its iterator is made) cannot redo an epoch's order after a restart.
    sampler = _sampler_of(loader)
    if isinstance(sampler, RandomSampler) and not isinstance(sampler, SeedableRandomSampler):
        raise ValueError(
            "the loader shuffles with an unseeded sampler: a restart would see another order; "
            "create the Accelerator with dataloader_config=DataLoaderConfiguration("
            "use_seedable_sampler=True) (each epoch's order from the seed and the epoch)"
        )


def _sampler_of(loader: Any) -> Any:
    # through Accelerate's BatchSamplerShard (several processes) to the BatchSampler's sampler
    batches: Any = getattr(loader, "batch_sampler", None)
    while hasattr(batches, "batch_sampler"):
        batches = batches.batch_sampler
    return getattr(batches, "sampler", None)
