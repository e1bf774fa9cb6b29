"""Hugging Face ``transformers.Trainer`` integration: one callback checkpoints every step.

    trainer = Trainer(model=model, args=args, train_dataset=data)
    trainer.add_callback(GeminiCallback(trainer))  # restore at train begin, snapshot every step
    trainer.train()

``on_train_begin`` (the model is wrapped, the optimizer and LR scheduler exist) builds a
``Checkpointer`` on them and restores the version the launcher designates. A restore puts back
the weights, the optimizer and scheduler state, the RNG states and the Trainer's progress
(``TrainerState``: global step, epoch, log history, ...), and then resumes the data where the
restored step left it: the epochs before it are skipped, and the Trainer's own mid-epoch resume
(``skip_first_batches``, then the RNG state put back after the first batch is fetched) runs with
the restored position instead of a checkpoint folder. ``on_step_end`` snapshots every optimizer
step as version ``state.global_step``; ``on_train_end`` waits for the last commit.

Bit-exact as far as the Trainer's own resume is: the data must come from a sampler the Trainer
seeds per epoch (its default), and a collator that draws random numbers (e.g. masking) draws
them again for the batches of the first resumed step. Callbacks' own state
(``stateful_callbacks``) is not restored, and of ``log_history`` the newest
``LOG_HISTORY_KEPT`` entries are.
"""

from __future__ import annotations

import logging
from typing import Any

from gemini_trainer.capture import Tree, capture_rng, restore_rng
from gemini_trainer.checkpointer import Checkpointer

try:
    from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState
    from transformers.training_args import TrainingArguments
except ImportError as err:  # the `hf` extra
    raise ImportError(
        "gemini_trainer.hf needs transformers and accelerate: pip install 'gemini-operator[hf]'"
    ) from err

log = logging.getLogger(__name__)

# TrainerState fields that are progress (the rest comes from this run's TrainingArguments)
PROGRESS = ("global_step", "epoch", "total_flos", "num_input_tokens_seen", "log_history",
            "best_metric", "best_global_step", "best_model_checkpoint")
# What the Trainer's mid-epoch resume is given instead of a checkpoint folder: it only passes it
# back to _load_rng_state, which this callback answers with the restored RNG states.
RESUME_MARK = "<gemini: restored from memory>"
# The newest log_history entries kept in a snapshot: the whole history grows with every logged
# step and would outgrow the slot (sized by the first snapshot plus a little headroom).
LOG_HISTORY_KEPT = 64


class GeminiCallback(TrainerCallback):  # type: ignore[misc]
    """Restores at train begin, snapshots at every step end (see the module docstring)."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer
        self.checkpointer: Checkpointer | None = None
        self.restored_step: int | None = None
        self._rng: Tree = None  # the restored RNG states, put back where the Trainer would

    def on_train_begin(self, args: TrainingArguments, state: TrainerState,
                       control: TrainerControl, **kwargs: Any) -> None:
        trainer = self.trainer
        self.checkpointer = Checkpointer(
            trainer.model_wrapped, trainer.optimizer, trainer.lr_scheduler)
        self.restored_step = self.checkpointer.restore()
        if self.restored_step is None:
            return
        _apply_progress(state, self.checkpointer.extra_state["trainer_state"])
        # the Trainer read these before the callback ran; its loss average and speed need them
        trainer._globalstep_last_logged = state.global_step
        trainer._initial_global_step = state.global_step
        trainer._initial_num_input_tokens_seen = state.num_input_tokens_seen
        self._rng = capture_rng()
        self._resume_data_at(state.global_step)
        log.info("resuming at step %d (epoch %.3f)", state.global_step, state.epoch)

    def on_step_end(self, args: TrainingArguments, state: TrainerState,
                    control: TrainerControl, **kwargs: Any) -> None:
        assert self.checkpointer is not None
        progress = {name: getattr(state, name) for name in PROGRESS}
        progress["log_history"] = progress["log_history"][-LOG_HISTORY_KEPT:]
        self.checkpointer.snapshot(state.global_step, extra={"trainer_state": progress})

    def on_train_end(self, args: TrainingArguments, state: TrainerState,
                     control: TrainerControl, **kwargs: Any) -> None:
        if self.checkpointer is not None:
            self.checkpointer.close()

    def _resume_data_at(self, global_step: int) -> None:
        """Run the Trainer's epoch loop from the restored step: the epochs before it do
        nothing, the one it is in resumes mid-epoch as the Trainer's own resume does."""
        trainer: Any = self.trainer  # its two methods are replaced on this instance only
        run_epoch, load_rng = trainer._run_epoch, trainer._load_rng_state

        def resumed_epoch(*, epoch: int, num_update_steps_per_epoch: int, **kw: Any) -> Any:
            first = global_step // num_update_steps_per_epoch
            if epoch < first:
                return None  # trained before the snapshot
            del trainer._run_epoch  # later epochs run as usual
            kw.update(epochs_trained=first, resume_from_checkpoint=RESUME_MARK,
                      steps_trained_in_current_epoch=(global_step % num_update_steps_per_epoch)
                      * trainer.args.gradient_accumulation_steps)
            return run_epoch(epoch=epoch, num_update_steps_per_epoch=num_update_steps_per_epoch,
                             **kw)

        def restored_rng(checkpoint: str | None) -> None:
            if checkpoint != RESUME_MARK:
                load_rng(checkpoint)
                return
            del trainer._load_rng_state
            restore_rng(self._rng)

        trainer._run_epoch = resumed_epoch
        trainer._load_rng_state = restored_rng


def _apply_progress(state: TrainerState, saved: dict[str, Any]) -> None:
    for name in PROGRESS:
        setattr(state, name, saved[name])
