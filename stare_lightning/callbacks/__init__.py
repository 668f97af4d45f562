"""Callbacks: entropy guard, rollout sample dump, end-of-fit summary, final-state checkpoint, step progress bar."""

from stare_lightning.lazy_exports import lazy_exports

_EXPORTS = {
    ".entropy_guard": ("EntropyGuard",),
    ".final_checkpoint": ("FinalStateCheckpoint",),
    ".progress": ("StepProgressBar",),
    ".run_summary": ("RunSummary",),
    ".sample_dump": ("RolloutSampleDump",),
}
__getattr__, __dir__, __all__ = lazy_exports(__name__, _EXPORTS)
