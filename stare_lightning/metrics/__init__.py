"""Telemetry of STARE runs as torchmetrics classes over pure functions (``functional``, ``step_stats``).

Every ``compute()`` returns a flat dict keyed by the project's metric names without the ``train/`` or
``val/`` prefix, which the caller adds. ``telemetry`` composes them into the per-step training and the
per-epoch validation telemetry. Plotting of logged runs lives in ``stare_lightning.metrics.plots`` (not
imported here, to keep matplotlib and pandas out of training imports).
"""

from stare_lightning.metrics.accuracy import AvgAtN, DistinctCorrect, MajorityAtN, PassAtK
from stare_lightning.metrics.base import TelemetryMetric
from stare_lightning.metrics.entropy import EntropyForecast, QuadrantMass, SameBatchEntropyChange, TokenEntropy
from stare_lightning.metrics.functional import DEFAULT_REFLECTION_WORDS, QUADRANT_DEFINITIONS, QUADRANTS
from stare_lightning.metrics.step_stats import (
    ClipFraction,
    FracZeroStdGroups,
    GateRate,
    GradNorm,
    ResponseLength,
    RewardStats,
    RolloutCounters,
    SelectedFraction,
    TruncatedFraction,
    UpdateLoss,
)
from stare_lightning.metrics.text import ReflectionWords

__all__ = [
    "AvgAtN",
    "ClipFraction",
    "DEFAULT_REFLECTION_WORDS",
    "DistinctCorrect",
    "EntropyForecast",
    "FracZeroStdGroups",
    "GateRate",
    "GradNorm",
    "MajorityAtN",
    "PassAtK",
    "QUADRANTS",
    "QUADRANT_DEFINITIONS",
    "QuadrantMass",
    "SameBatchEntropyChange",
    "ReflectionWords",
    "ResponseLength",
    "RewardStats",
    "RolloutCounters",
    "SelectedFraction",
    "TelemetryMetric",
    "TokenEntropy",
    "TruncatedFraction",
    "UpdateLoss",
]
