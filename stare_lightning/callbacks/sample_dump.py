"""Append a few of a step's rollouts (prompt, responses, rewards, advantages) to a JSONL file.

Steps are rollout batches (``batch_idx``), not optimizer steps: one rollout batch may feed several
optimizer steps (PPO epochs and mini-batches), and a skipped non-finite step takes none.
"""

from __future__ import annotations

import json
from pathlib import Path

import lightning
from lightning.pytorch.callbacks import Callback

from stare_lightning.config.checks import number, text


class RolloutSampleDump(Callback):
    """Appends a few groups of a step's rollouts to ``<output_dir>/<filename>`` (JSONL, one group a line).

    Args:
        every_n_steps: rollout batches between two dumps.
        max_groups: prompt groups written per dump (each with all its responses, rewards and advantages).
        filename: the file, under the trainer's ``default_root_dir``.
    """

    def __init__(self, every_n_steps: int = 10, max_groups: int = 4, filename: str = "rollouts.jsonl") -> None:
        number("callbacks.sample_dump.every_n_steps", every_n_steps, low=1, integer=True)
        number("callbacks.sample_dump.max_groups", max_groups, low=1, integer=True)
        text("callbacks.sample_dump.filename", filename)
        self.every_n_steps, self.max_groups, self.filename = every_n_steps, max_groups, filename

    def path(self, trainer: lightning.Trainer) -> Path:
        return Path(trainer.default_root_dir) / self.filename

    def on_train_batch_end(self, trainer: lightning.Trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        samples = getattr(pl_module, "last_rollout_samples", None)
        if not samples or trainer.global_rank != 0 or batch_idx % self.every_n_steps:
            return
        path = self.path(trainer)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as handle:
            for group in samples[: self.max_groups]:
                record = {"batch": batch_idx, "step": trainer.global_step, **group}
                handle.write(json.dumps(record) + "\n")
