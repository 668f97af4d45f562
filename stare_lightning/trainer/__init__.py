"""The Lightning glue: the FSDP2 strategy, the resumable CSV logger, checkpoint IO and the optimizer."""

from stare_lightning.lazy_exports import lazy_exports

_EXPORTS = {
    ".checkpoint_io": ("CheckpointWriteError", "SafeCheckpointIO"),
    ".config": ("OptimConfig",),
    ".loggers": ("ResumableCSVLogger",),
    ".optim": ("build_optimizer", "lr_multiplier"),
    ".strategies": ("FSDP2Strategy",),
}
__getattr__, __dir__, __all__ = lazy_exports(__name__, _EXPORTS)
