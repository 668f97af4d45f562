"""A Rich progress bar that counts optimizer steps toward ``trainer.max_steps``.

A fit here is one endless epoch bounded by ``max_steps``, so Lightning's own label ("Epoch 0/-2") says
nothing; this one reads ``step k/max_steps`` and is updated after every training batch.
"""

from __future__ import annotations

import lightning
from lightning.pytorch.callbacks import RichProgressBar


class StepProgressBar(RichProgressBar):
    """Lightning's Rich progress bar labelled ``step k/max_steps``; it takes ``RichProgressBar``'s arguments."""

    def _get_train_description(self, current_epoch: int) -> str:
        return self.step_description(self.trainer)

    @staticmethod
    def step_description(trainer: lightning.Trainer) -> str:
        return f"step {trainer.global_step}/{trainer.max_steps}"

    def on_train_batch_end(self, trainer: lightning.Trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if self.progress is not None and self.train_progress_bar_id is not None:
            self.progress.update(self.train_progress_bar_id, description=self.step_description(trainer))
            self.refresh()
