"""``FinalStateCheckpoint``: Lightning's ``ModelCheckpoint`` whose checkpoints lose neither the final step nor a
validation.

- Lightning writes ``last`` at the end of training only when the run wrote no ``last`` before. A run whose
  ``max_steps`` is not a multiple of ``every_n_train_steps`` therefore ends with a ``last.ckpt`` from an earlier
  step: ``export`` would ship stale weights and a resume would redo the final steps. This subclass writes
  ``last`` once more when training ends past the step it last saved.
- Lightning writes a periodic checkpoint in ``on_train_batch_end``, before the validation that follows the same
  batch, and a resume from it fast-forwards past that validation: a run killed while validating never gets that
  point. On a step that validation follows, this subclass saves after the validation instead (a kill during it
  then resumes from the checkpoint before, and the validation runs again).

It calls ModelCheckpoint's own (private) save helpers and the epoch loop's own test for "validation follows this
batch", as Lightning's hooks do; ``tests/test_callbacks.py`` checks both behaviours against plain
``ModelCheckpoint`` on the pinned Lightning, ``tests/test_fsdp.py`` the final step under FSDP.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint


class FinalStateCheckpoint(ModelCheckpoint):
    """Lightning's ``ModelCheckpoint`` whose ``last`` checkpoint holds the final step and the last validation (the
    module's docstring says when Lightning's own misses them); it takes ``ModelCheckpoint``'s arguments."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._save_after_validation = False

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any, **kwargs: Any) -> None:
        if self._periodic_save_due(trainer) and _validation_follows(trainer):
            self._save_after_validation = True
            return
        super().on_train_batch_end(trainer, pl_module, *args, **kwargs)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._save_after_validation and not self._should_skip_saving_checkpoint(trainer):
            candidates = self._monitor_candidates(trainer)
            self._save_topk_checkpoint(trainer, candidates)
            self._save_last_checkpoint(trainer, candidates)
        self._save_after_validation = False
        super().on_validation_end(trainer, pl_module)  # a no-op for this step once it is saved

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # The skip check is True when this step is already saved, when not fitting and during sanity checks.
        if self.save_last and not self._should_skip_saving_checkpoint(trainer):
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))
        super().on_train_end(trainer, pl_module)

    def _periodic_save_due(self, trainer: pl.Trainer) -> bool:
        every = self._every_n_train_steps
        return every >= 1 and trainer.global_step % every == 0 and not self._should_skip_saving_checkpoint(trainer)


def _validation_follows(trainer: pl.Trainer) -> bool:
    """Whether the fit loop validates right after the current training batch (its own test, at the same state:
    the batch's progress is counted before ``on_train_batch_end``, the test runs after it)."""
    fit_loop = trainer.fit_loop
    return fit_loop.epoch_loop._should_check_val_fx(fit_loop._data_fetcher)
