"""Append a few of each step's rollouts (prompt, responses, rewards, advantages) to a JSONL file."""

from __future__ import annotations

import json
from pathlib import Path

import lightning
from lightning.pytorch.callbacks import Callback


class RolloutSampleDump(Callback):
    def __init__(self, every_n_steps: int = 10, max_groups: int = 4, filename: str = "rollouts.jsonl") -> None:
        if every_n_steps < 1 or max_groups < 1:
            raise ValueError(
                f"callbacks.sample_dump needs every_n_steps >= 1 and max_groups >= 1, got {every_n_steps}, {max_groups}"
            )
        self.every_n_steps, self.max_groups, self.filename = every_n_steps, max_groups, filename

    def path(self, trainer: lightning.Trainer) -> Path:
        return Path(trainer.default_root_dir) / self.filename

    def on_train_batch_end(self, trainer: lightning.Trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        samples = getattr(pl_module, "last_rollout_samples", None)
        if not samples or trainer.global_rank != 0 or (trainer.global_step - 1) % self.every_n_steps:
            return
        path = self.path(trainer)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as handle:
            for group in samples[: self.max_groups]:
                handle.write(json.dumps({"step": trainer.global_step, **group}) + "\n")
