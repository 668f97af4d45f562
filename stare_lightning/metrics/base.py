"""Shared plumbing of the telemetry metrics: a torchmetrics base with sum states, and a cross-rank
reduction for states every rank holds identically.

Not from the paper. States default to float64 sums and int64 counts; on a device without float64
(Apple MPS) call ``metric.set_dtype(torch.float32)`` before moving the metric there.
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor
from torchmetrics import Metric


class TelemetryMetric(Metric):
    """Base of the telemetry metrics: non-differentiable, states merged by their reductions."""

    is_differentiable = False
    higher_is_better = None
    full_state_update = False

    def _sum_state(self, name: str, shape: tuple[int, ...] = (), dtype: torch.dtype = torch.float64) -> None:
        self.add_state(name, default=torch.zeros(shape, dtype=dtype), dist_reduce_fx="sum")

    def _accumulate(self, **values: Tensor) -> None:
        """Add each value to the sum state of the same name (cast to the state's device and dtype)."""
        for name, value in values.items():
            state = getattr(self, name)
            setattr(self, name, state + value.to(state))


def replicated(stacked: Tensor) -> Tensor:
    """Cross-rank reduction for a state that every rank holds identically: keep rank 0's copy.

    ``stacked`` is the states of all ranks stacked on dim 0. If the copies disagree (the caller fed
    rank-local values where global ones were expected), warn: the result is then rank 0's view only.
    """
    first = stacked[0]
    a = stacked.to(torch.float64)
    b = first.to(torch.float64).expand_as(a)
    if not bool(torch.isclose(a, b, rtol=1e-6, atol=1e-12, equal_nan=True).all()):
        warnings.warn(
            "a replicated metric state differs across ranks; feed globally reduced values on every rank. "
            "Keeping rank 0's copy.",
            RuntimeWarning,
            stacklevel=2,
        )
    return first
