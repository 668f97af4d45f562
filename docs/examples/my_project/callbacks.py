"""A callback: after every training step, append the step's chosen metrics to a JSON Lines file."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from lightning.pytorch.callbacks import Callback


class MetricsJournal(Callback):
    """Writes one line per training step: ``{"step": ..., "<metric>": value, ...}``, where ``step`` is the number of
    optimizer steps taken so far (``trainer.global_step``, 1 after the first step).

    Args:
        path: the file the lines are appended to.
        keys: the logged metrics to write; a metric the step did not log is left out of its line.
    """

    def __init__(self, path: str, keys: Sequence[str] = ("train/reward/mean", "train/entropy")) -> None:
        keys = list(keys)
        if not keys or not all(isinstance(key, str) and key for key in keys):
            raise ValueError(f"callbacks.journal.keys={keys!r} is not allowed: must be a non-empty list of names")
        self.path, self.keys = Path(path), keys

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if not trainer.is_global_zero:  # one writer under DDP and FSDP
            return
        logged = trainer.callback_metrics
        line = {"step": trainer.global_step, **{key: float(logged[key]) for key in self.keys if key in logged}}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as handle:
            handle.write(json.dumps(line) + "\n")
