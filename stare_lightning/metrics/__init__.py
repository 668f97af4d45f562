"""Telemetry of STARE runs as torchmetrics classes over pure functions (``functional``, ``step_stats``).

Every ``compute()`` returns a flat dict keyed by the project's metric names without the ``train/`` or
``val/`` prefix, which the caller adds. ``telemetry`` composes them into the per-step training and the
per-epoch validation telemetry. Loading and plotting logged runs is ``stare_lightning.analysis``'s (a layer above:
nothing here may import it).
"""

from stare_lightning.lazy_exports import lazy_exports

_EXPORTS = {
    "AvgAtN": "stare_lightning.metrics.accuracy",
    "DistinctCorrect": "stare_lightning.metrics.accuracy",
    "MajorityAtN": "stare_lightning.metrics.accuracy",
    "PassAtK": "stare_lightning.metrics.accuracy",
    "TelemetryMetric": "stare_lightning.metrics.base",
    "EntropyForecast": "stare_lightning.metrics.entropy",
    "QuadrantMass": "stare_lightning.metrics.entropy",
    "SameBatchEntropyChange": "stare_lightning.metrics.entropy",
    "TokenEntropy": "stare_lightning.metrics.entropy",
    "DEFAULT_REFLECTION_WORDS": "stare_lightning.metrics.functional",
    "QUADRANT_DEFINITIONS": "stare_lightning.metrics.functional",
    "QUADRANTS": "stare_lightning.metrics.functional",
    "ClipFraction": "stare_lightning.metrics.step_stats",
    "FracZeroStdGroups": "stare_lightning.metrics.step_stats",
    "GateRate": "stare_lightning.metrics.step_stats",
    "GradNorm": "stare_lightning.metrics.step_stats",
    "ResponseLength": "stare_lightning.metrics.step_stats",
    "RewardStats": "stare_lightning.metrics.step_stats",
    "RolloutCounters": "stare_lightning.metrics.step_stats",
    "SelectedFraction": "stare_lightning.metrics.step_stats",
    "TruncatedFraction": "stare_lightning.metrics.step_stats",
    "UpdateLoss": "stare_lightning.metrics.step_stats",
    "ReflectionWords": "stare_lightning.metrics.text",
    "stare_step_metrics": "stare_lightning.metrics.stare_step",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)
