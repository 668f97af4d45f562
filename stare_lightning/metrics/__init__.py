"""Telemetry of STARE runs as torchmetrics classes over pure functions (``functional``).

Every ``compute()`` returns a flat dict keyed by the project's metric names without the ``train/`` or
``val/`` prefix, which the caller adds. Plotting of logged runs lives in ``stare_lightning.metrics.plots``
(not imported here, to keep matplotlib and pandas out of training imports).
"""

from stare_lightning.metrics.accuracy import AvgAtN, DistinctCorrect, PassAtK
from stare_lightning.metrics.base import StareMetric
from stare_lightning.metrics.entropy import EntropyForecast, QuadrantMass, TokenEntropy
from stare_lightning.metrics.functional import DEFAULT_REFLECTION_WORDS, QUADRANT_DEFINITIONS, QUADRANTS
from stare_lightning.metrics.rollout import ClipFraction, FracZeroStdGroups, GateRate, ResponseLength
from stare_lightning.metrics.text import ReflectionWords

__all__ = [
    "AvgAtN",
    "ClipFraction",
    "DEFAULT_REFLECTION_WORDS",
    "DistinctCorrect",
    "EntropyForecast",
    "FracZeroStdGroups",
    "GateRate",
    "PassAtK",
    "QUADRANTS",
    "QUADRANT_DEFINITIONS",
    "QuadrantMass",
    "ReflectionWords",
    "ResponseLength",
    "StareMetric",
    "TokenEntropy",
]
