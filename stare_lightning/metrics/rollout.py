"""Bookkeeping metrics of a training step: response length, PPO clip fractions, STARE gate rate and the
fraction of groups whose rewards all agree.

Standard RLVR telemetry, not specific to the paper. Thin torchmetrics classes over ``functional``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from stare_lightning.metrics.base import StareMetric
from stare_lightning.metrics.functional import (
    _clip_fraction_compute,
    _clip_fraction_update,
    _gate_rate_compute,
    _gate_rate_update,
    _response_length_compute,
    _response_length_update,
    _zero_std_groups_compute,
    _zero_std_groups_update,
    clip_masks,
)


class ResponseLength(StareMetric):
    """Mean and max response length: ``response_length/mean``, ``response_length/max``.

    ``update(lengths [N])``, or a response mask [N, T] (its row sums are the lengths). The max is synced
    with a max reduction; both are NaN when no response was seen.
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._sum_state("total")
        self._sum_state("count", dtype=torch.int64)
        self.add_state("top", default=torch.zeros((), dtype=torch.float64), dist_reduce_fx="max")

    def update(self, lengths: Tensor) -> None:
        total, count, top = _response_length_update(lengths)
        self._accumulate(total=total, count=count)
        self.top = torch.maximum(self.top, top.to(self.top))

    def compute(self) -> dict[str, Tensor]:
        return _response_length_compute(self.total, self.count, self.top)


class ClipFraction(StareMetric):
    """Fraction of valid tokens where the PPO clip binds: ``clip_ratio/low``, ``clip_ratio/high``.

    ``update(ratio [B, T], advantages [B, T] or [B], mask [B, T])``: low counts A < 0 with
    r < 1 - eps_low, high counts A > 0 with r > 1 + eps_high (the tokens whose gradient the clip removes).
    The denominator is every valid token. Accumulates over all micro-batches and epochs of a step.
    """

    def __init__(self, eps_low: float, eps_high: float, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.eps_low = float(eps_low)
        self.eps_high = float(eps_high)
        self._sum_state("low", dtype=torch.int64)
        self._sum_state("high", dtype=torch.int64)
        self._sum_state("count", dtype=torch.int64)

    def update(self, ratio: Tensor, advantages: Tensor, mask: Tensor) -> None:
        clipped_low, clipped_high = clip_masks(ratio, advantages, self.eps_low, self.eps_high)
        low, high, count = _clip_fraction_update(clipped_low, clipped_high, mask)
        self._accumulate(low=low, high=high, count=count)

    def compute(self) -> dict[str, Tensor]:
        return _clip_fraction_compute(self.low, self.high, self.count)


class GateRate(StareMetric):
    """Fraction of steps with the STARE gate on: ``stare/gate_on``.

    ``update(gate_on: bool | Tensor)``, once per step (or a tensor of per-step flags). The gate is global,
    so every rank feeds the same flag; the sum reduction then scales numerator and denominator alike.
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._sum_state("on", dtype=torch.int64)
        self._sum_state("steps", dtype=torch.int64)

    def update(self, gate_on: bool | Tensor) -> None:
        on, steps = _gate_rate_update(gate_on)
        self._accumulate(on=on, steps=steps)

    def compute(self) -> dict[str, Tensor]:
        return _gate_rate_compute(self.on, self.steps)


class FracZeroStdGroups(StareMetric):
    """Fraction of prompt groups whose rewards all agree (zero advantage): ``frac_zero_std_groups``.

    ``update(rewards [P, G], mask [P, G] | None)``; agreement means max - min <= ``atol``.
    """

    def __init__(self, atol: float = 0.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.atol = float(atol)
        self._sum_state("zero", dtype=torch.int64)
        self._sum_state("groups", dtype=torch.int64)

    def update(self, rewards: Tensor, mask: Tensor | None = None) -> None:
        zero, groups = _zero_std_groups_update(rewards, mask, self.atol)
        self._accumulate(zero=zero, groups=groups)

    def compute(self) -> dict[str, Tensor]:
        return _zero_std_groups_compute(self.zero, self.groups)
