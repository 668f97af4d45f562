"""``FinalStateCheckpoint``: Lightning's ``ModelCheckpoint`` whose ``last.ckpt`` always ends at the final step.

Lightning writes ``last`` at the end of training only when the run wrote no ``last`` before. A run whose
``max_steps`` is not a multiple of ``every_n_train_steps`` therefore ends with a ``last.ckpt`` from an
earlier step: ``export`` would ship stale weights and a resume would redo the final steps. This subclass
writes ``last`` once more when training ends past the step it last saved. It calls ModelCheckpoint's own
(private) save helpers, as its hooks do; ``tests/test_fsdp.py`` checks the final step lands in ``last.ckpt``.
"""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint


class FinalStateCheckpoint(ModelCheckpoint):
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # The skip check is True when this step is already saved, when not fitting and during sanity checks.
        if self.save_last and not self._should_skip_saving_checkpoint(trainer):
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))
        super().on_train_end(trainer, pl_module)
