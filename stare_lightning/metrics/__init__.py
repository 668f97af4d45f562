"""Telemetry of STARE runs as torchmetrics classes over pure functions (``functional``, ``step_stats``).

Every ``compute()`` returns a flat dict keyed by the project's metric names without the ``train/`` or
``val/`` prefix, which the caller adds. ``telemetry`` composes them into the per-step training and the
per-epoch validation telemetry. Loading and plotting logged runs is ``stare_lightning.analysis``'s (a layer above:
nothing here may import it).
"""

from stare_lightning.lazy_exports import lazy_exports

_EXPORTS = {
    ".accuracy": ("AvgAtN", "DistinctCorrect", "MajorityAtN", "PassAtK"),
    ".base": ("TelemetryMetric",),
    ".entropy": ("EntropyForecast", "QuadrantMass", "SameBatchEntropyChange", "TokenEntropy"),
    ".functional": ("DEFAULT_REFLECTION_WORDS", "QUADRANT_DEFINITIONS", "QUADRANTS"),
    ".step_stats": (
        "ClipFraction",
        "FracZeroStdGroups",
        "GateRate",
        "GradNorm",
        "ResponseLength",
        "RewardStats",
        "RolloutCounters",
        "SelectedFraction",
        "TruncatedFraction",
        "UpdateLoss",
    ),
    ".text": ("ReflectionWords",),
    ".stare_step": ("stare_step_metrics",),
}
__getattr__, __dir__, __all__ = lazy_exports(__name__, _EXPORTS)
