"""The Lightning glue: the FSDP2 strategy, the resumable CSV logger, checkpoint IO and the optimizer."""

from stare_lightning.trainer.checkpoint_io import CheckpointWriteError, SafeCheckpointIO
from stare_lightning.trainer.config import OptimConfig
from stare_lightning.trainer.loggers import ResumableCSVLogger
from stare_lightning.trainer.optim import build_optimizer, lr_multiplier
from stare_lightning.trainer.strategies import FSDP2Strategy

__all__ = [
    "CheckpointWriteError",
    "FSDP2Strategy",
    "OptimConfig",
    "ResumableCSVLogger",
    "SafeCheckpointIO",
    "build_optimizer",
    "lr_multiplier",
]
