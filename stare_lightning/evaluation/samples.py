"""The callback that gathers the sample records (``data.samples``) of a validation epoch from every rank."""

from __future__ import annotations

from collections.abc import Sequence

import lightning
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback

from stare_lightning.distributed import is_distributed


class SampleRecorder(Callback):
    """Keeps what ``validation_step`` returns; after the epoch, ``samples`` holds every rank's records on
    every rank, in a fixed order (benchmark order of first appearance, then id, then sample index)."""

    def __init__(self, benchmarks: Sequence[str]) -> None:
        self.order = {name: i for i, name in enumerate(benchmarks)}
        self.samples: list[dict] = []

    def on_validation_epoch_start(self, trainer: lightning.Trainer, pl_module) -> None:
        self.samples = []

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        if outputs:
            self.samples.extend(outputs["samples"])

    def on_validation_epoch_end(self, trainer: lightning.Trainer, pl_module) -> None:
        if is_distributed():
            parts: list[list[dict]] = [[] for _ in range(dist.get_world_size())]
            dist.all_gather_object(parts, self.samples)
            self.samples = [record for part in parts for record in part]
        self.samples.sort(key=lambda r: (self.order.get(r["benchmark"], len(self.order)), str(r["id"]), r["sample"]))
