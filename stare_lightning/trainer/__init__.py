"""The Lightning glue: the FSDP2 strategy, the resumable CSV logger, checkpoint IO and the optimizer."""

from stare_lightning.lazy_exports import lazy_exports

_EXPORTS = {
    "CheckpointWriteError": "stare_lightning.trainer.checkpoint_io",
    "SafeCheckpointIO": "stare_lightning.trainer.checkpoint_io",
    "OptimConfig": "stare_lightning.trainer.config",
    "ResumableCSVLogger": "stare_lightning.trainer.loggers",
    "build_optimizer": "stare_lightning.trainer.optim",
    "lr_multiplier": "stare_lightning.trainer.optim",
    "FSDP2Strategy": "stare_lightning.trainer.strategies",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)
