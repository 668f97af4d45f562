"""Callbacks: entropy guard, rollout sample dump, end-of-fit summary, final-state checkpoint, step progress bar."""

from stare_lightning.callbacks.entropy_guard import EntropyGuard
from stare_lightning.callbacks.final_checkpoint import FinalStateCheckpoint
from stare_lightning.callbacks.progress import StepProgressBar
from stare_lightning.callbacks.run_summary import RunSummary
from stare_lightning.callbacks.sample_dump import RolloutSampleDump

__all__ = ["EntropyGuard", "FinalStateCheckpoint", "RolloutSampleDump", "RunSummary", "StepProgressBar"]
