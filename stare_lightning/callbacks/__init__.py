"""Callbacks: entropy guard, rollout sample dump, end-of-fit summary, final-state checkpoint, step progress bar."""

from stare_lightning.lazy_exports import lazy_exports

_EXPORTS = {
    "EntropyGuard": "stare_lightning.callbacks.entropy_guard",
    "FinalStateCheckpoint": "stare_lightning.callbacks.final_checkpoint",
    "StepProgressBar": "stare_lightning.callbacks.progress",
    "RunSummary": "stare_lightning.callbacks.run_summary",
    "RolloutSampleDump": "stare_lightning.callbacks.sample_dump",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)
