"""Checkpoint writes that fail clearly and never damage the checkpoint already on disk; reads that load data only.

Lightning's ``TorchCheckpointIO`` already writes local files through a temporary file that is moved into
place only when complete, so a write that dies half-way (disk full, quota, file-size limit) leaves the
previous ``last.ckpt`` intact. What it lacks is a message a user can act on: this subclass turns the bare
``OSError`` into one that names the file, the cause, and what was kept. Reads always use ``weights_only=True``,
whatever the caller asks (``trainer/checkpoint_trust.py`` states the policy).
"""

from __future__ import annotations

import errno
import os
import pickle
from pathlib import Path
from typing import Any

from lightning.pytorch.plugins.io import TorchCheckpointIO

from stare_lightning.trainer.checkpoint_trust import untrusted_content


class CheckpointWriteError(OSError):
    pass


class SafeCheckpointIO(TorchCheckpointIO):
    """Lightning's ``TorchCheckpointIO`` whose failed writes name the file and the cause and keep the previous
    checkpoint, and whose reads load data only (the module's docstring says how)."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        try:
            super().save_checkpoint(checkpoint, path, storage_options)
        except OSError as error:
            cause = os.strerror(error.errno) if error.errno else str(error)
            kept = f"the previous file at {path} is unchanged" if os.path.exists(path) else "no earlier file existed"
            hint = (
                " Free disk space or point callbacks.model_checkpoint.dirpath elsewhere."
                if error.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
                else ""
            )
            raise CheckpointWriteError(
                error.errno, f"could not write checkpoint {path}: {cause}; {kept}.{hint}"
            ) from error

    def load_checkpoint(self, path, map_location: Any | None = None, weights_only: bool | None = None) -> dict:
        try:
            return super().load_checkpoint(path, map_location=map_location, weights_only=True)
        except pickle.UnpicklingError as exc:
            raise untrusted_content(Path(path), "holds objects other than tensors and plain values", exc) from None
