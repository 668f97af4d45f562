"""Bookkeeping metrics of a training step: rewards, response length, zero-variance groups, STARE's gate and
selection, truncated responses, PPO clip fractions, the loss and gradient norm of the update, and rollout counters.

Standard RLVR telemetry, not specific to the paper. Each metric is a functional ``_update``/``_compute``
pair and a thin class, as in ``functional``. States are sums (float64) or counts (int64) reduced by
summing across ranks, except the few that every rank holds identically (optimizer steps, gradient
norms, generation batches, which run in lockstep): those keep rank 0's copy.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from stare_lightning.metrics.base import TelemetryMetric, replicated
from stare_lightning.metrics.functional import (
    _COUNT,
    _SUM,
    _ratio,
    _selected_fraction_compute,
    _selected_fraction_update,
)


def _scalar(value: Tensor | float, dtype: torch.dtype = _SUM) -> Tensor:
    return torch.as_tensor(value).detach().reshape(()).to(dtype)


# --------------------------------------------------------------------------------------- pure functions


def _reward_update(rewards: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Rewards of any shape -> (sum, sum of squares, count)."""
    r = rewards.detach().reshape(-1).to(_SUM)
    return r.sum(), (r * r).sum(), torch.tensor(r.numel(), dtype=_COUNT, device=r.device)


def _reward_compute(total: Tensor, squares: Tensor, count: Tensor) -> dict[str, Tensor]:
    n = count.to(_SUM).clamp(min=1)
    mean = total / n
    return {"reward/mean": mean, "reward/std": (squares / n - mean * mean).clamp(min=0).sqrt()}


def _response_length_update(lengths: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Lengths [N] (or a response mask [N, T], summed over T) -> (sum, count, max; max is 0 if empty)."""
    if lengths.dim() == 2:
        lengths = lengths.to(_SUM).sum(dim=-1)
    lengths = lengths.reshape(-1).to(_SUM)
    top = lengths.max() if lengths.numel() else torch.zeros((), dtype=_SUM, device=lengths.device)
    return lengths.sum(), torch.tensor(lengths.numel(), dtype=_COUNT, device=lengths.device), top


def _response_length_compute(total: Tensor, count: Tensor, top: Tensor) -> dict[str, Tensor]:
    return {
        "response_length/mean": _ratio(total, count),
        "response_length/max": torch.where(count > 0, top.to(_SUM), torch.full_like(top, float("nan"), dtype=_SUM)),
    }


def _zero_std_groups_update(zero_std: Tensor) -> tuple[Tensor, Tensor]:
    """Bool [groups], True where a group's rewards all agree -> (agreeing groups, groups)."""
    flags = zero_std.reshape(-1).bool()
    return flags.sum().to(_COUNT), torch.tensor(flags.numel(), dtype=_COUNT, device=flags.device)


def _zero_std_groups_compute(zero: Tensor, groups: Tensor) -> dict[str, Tensor]:
    return {"frac_zero_std_groups": _ratio(zero, groups)}


def _gate_rate_update(gate_on: Tensor | bool) -> tuple[Tensor, Tensor]:
    """One gate flag (or a tensor of per-step flags) -> (steps with the gate on, steps)."""
    flags = torch.as_tensor(gate_on).reshape(-1).bool()
    return flags.sum().to(_COUNT), torch.tensor(flags.numel(), dtype=_COUNT, device=flags.device)


def _gate_rate_compute(on: Tensor, steps: Tensor) -> dict[str, Tensor]:
    return {"stare/gate_on": _ratio(on, steps)}


def _clip_fraction_compute(low: Tensor, high: Tensor, tokens: Tensor) -> dict[str, Tensor]:
    # Counts over every micro-batch and epoch of the step; the denominator is every valid token seen.
    tokens = tokens.clamp(min=1)
    return {"clip_ratio/low": _ratio(low, tokens), "clip_ratio/high": _ratio(high, tokens)}


def _update_loss_compute(loss: Tensor, pg_loss: Tensor, kl: Tensor, tokens: Tensor, steps: Tensor) -> dict[str, Tensor]:
    # Each rank adds its share of every optimizer step's loss (normalised by global counts): the sum over
    # ranks is the loss of the whole batch, averaged here over the optimizer steps of the rollout batch.
    steps = steps.to(_SUM).clamp(min=1)
    return {"loss": loss / steps, "pg_loss": pg_loss / steps, "kl": kl / tokens.to(_SUM).clamp(min=1)}


# ------------------------------------------------------------------------------------------- classes


class RewardStats(TelemetryMetric):
    """Mean and (population) standard deviation of rewards: ``reward/mean``, ``reward/std``."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._sum_state("total")
        self._sum_state("squares")
        self._sum_state("count", dtype=_COUNT)

    def update(self, rewards: Tensor) -> None:
        total, squares, count = _reward_update(rewards)
        self._accumulate(total=total, squares=squares, count=count)

    def compute(self) -> dict[str, Tensor]:
        return _reward_compute(self.total, self.squares, self.count)


class ResponseLength(TelemetryMetric):
    """Mean and max response length: ``response_length/mean``, ``response_length/max``.

    ``update(lengths [N])``, or a response mask [N, T] (its row sums are the lengths). The max is synced
    with a max reduction; both are NaN when no response was seen.
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._sum_state("total")
        self._sum_state("count", dtype=_COUNT)
        self.add_state("top", default=torch.zeros((), dtype=_SUM), dist_reduce_fx="max")

    def update(self, lengths: Tensor) -> None:
        total, count, top = _response_length_update(lengths)
        self._accumulate(total=total, count=count)
        self.top = torch.maximum(self.top, top.to(self.top))

    def compute(self) -> dict[str, Tensor]:
        return _response_length_compute(self.total, self.count, self.top)


class TruncatedFraction(TelemetryMetric):
    """Share of responses cut by the token budget: ``response_length/truncated_frac`` (NaN when none seen).

    ``update(truncated [N] bool)``, from the engines' finish reasons ("length").
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._sum_state("truncated", dtype=_COUNT)
        self._sum_state("count", dtype=_COUNT)

    def update(self, truncated: Tensor) -> None:
        flags = truncated.reshape(-1).bool()
        self._accumulate(truncated=flags.sum(), count=torch.tensor(flags.numel()))

    def compute(self) -> dict[str, Tensor]:
        return {"response_length/truncated_frac": _ratio(self.truncated, self.count)}


class FracZeroStdGroups(TelemetryMetric):
    """Fraction of prompt groups whose rewards all agree (zero advantage): ``frac_zero_std_groups``.

    ``update(zero_std [groups])`` with the flags of ``algorithms.zero_variance_groups``, the same test
    dynamic sampling filters on.
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._sum_state("zero", dtype=_COUNT)
        self._sum_state("groups", dtype=_COUNT)

    def update(self, zero_std: Tensor) -> None:
        zero, groups = _zero_std_groups_update(zero_std)
        self._accumulate(zero=zero, groups=groups)

    def compute(self) -> dict[str, Tensor]:
        return _zero_std_groups_compute(self.zero, self.groups)


class GateRate(TelemetryMetric):
    """Fraction of steps with the STARE gate on: ``stare/gate_on``.

    ``update(gate_on: bool | Tensor)``, once per step (or a tensor of per-step flags). The gate is global,
    so every rank feeds the same flag; the sum reduction then scales numerator and denominator alike.
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._sum_state("on", dtype=_COUNT)
        self._sum_state("steps", dtype=_COUNT)

    def update(self, gate_on: bool | Tensor) -> None:
        on, steps = _gate_rate_update(gate_on)
        self._accumulate(on=on, steps=steps)

    def compute(self) -> dict[str, Tensor]:
        return _gate_rate_compute(self.on, self.steps)


class SelectedFraction(TelemetryMetric):
    """Share of T+ and T- tokens in STARE's selected sets: ``stare/selected_frac/pos``, ``.../neg``.

    ``update(selected [B, T], advantages [B] or [B, T], mask [B, T])``.
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._sum_state("counts", (4,), dtype=_COUNT)

    def update(self, selected: Tensor, advantages: Tensor, mask: Tensor) -> None:
        self._accumulate(counts=_selected_fraction_update(selected, advantages, mask))

    def compute(self) -> dict[str, Tensor]:
        return _selected_fraction_compute(self.counts)


class ClipFraction(TelemetryMetric):
    """Fraction of valid tokens where the PPO clip binds: ``clip_ratio/low``, ``clip_ratio/high``.

    ``update(clip_low, clip_high, tokens)`` with the counts the loss reports for each micro-batch
    (``algorithms.clip_masks``: low, A < 0 and r < 1 - eps_low; high, A > 0 and r > 1 + eps_high).
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._sum_state("low", dtype=_COUNT)
        self._sum_state("high", dtype=_COUNT)
        self._sum_state("tokens", dtype=_COUNT)

    def update(self, clip_low: Tensor, clip_high: Tensor, tokens: Tensor) -> None:
        self._accumulate(low=_scalar(clip_low, _COUNT), high=_scalar(clip_high, _COUNT), tokens=_scalar(tokens, _COUNT))

    def compute(self) -> dict[str, Tensor]:
        return _clip_fraction_compute(self.low, self.high, self.tokens)


class UpdateLoss(TelemetryMetric):
    """The loss of a rollout batch's update: ``loss``, ``pg_loss`` (per optimizer step), ``kl`` (token mean).

    ``update(loss, pg_loss, kl_sum, tokens)`` once per micro-batch with its share of the step loss;
    ``update(steps=1)`` once per optimizer step (every rank takes the same steps).
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        for name in ("loss", "pg_loss", "kl", "tokens"):
            self._sum_state(name)
        self.add_state("steps", default=torch.zeros((), dtype=_COUNT), dist_reduce_fx=replicated)

    def update(
        self,
        loss: Tensor | float = 0.0,
        pg_loss: Tensor | float = 0.0,
        kl_sum: Tensor | float = 0.0,
        tokens: Tensor | float = 0.0,
        steps: int = 0,
    ) -> None:
        self._accumulate(
            loss=_scalar(loss),
            pg_loss=_scalar(pg_loss),
            kl=_scalar(kl_sum),
            tokens=_scalar(tokens),
            steps=torch.tensor(steps, dtype=_COUNT),
        )

    def compute(self) -> dict[str, Tensor]:
        return _update_loss_compute(self.loss, self.pg_loss, self.kl, self.tokens, self.steps)


class GradNorm(TelemetryMetric):
    """Mean gradient norm over the optimizer steps that were taken: ``grad_norm`` (NaN when none was).

    The norm is global (every rank computes the same value), so the states keep rank 0's copy.
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.add_state("total", default=torch.zeros((), dtype=_SUM), dist_reduce_fx=replicated)
        self.add_state("steps", default=torch.zeros((), dtype=_COUNT), dist_reduce_fx=replicated)

    def update(self, grad_norm: Tensor | float) -> None:
        self._accumulate(total=_scalar(grad_norm), steps=torch.tensor(1, dtype=_COUNT))

    def compute(self) -> dict[str, Tensor]:
        return {"grad_norm": _ratio(self.total, self.steps)}


class RolloutCounters(TelemetryMetric):
    """What collection cost: ``rollout/tokens_per_s``, ``generation_batches``, ``verifier/{timeouts,errors}``.

    Tokens and seconds are summed over ranks (throughput per rank-second); generation batches run in
    lockstep on every rank, so that state keeps rank 0's copy.
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        for name in ("tokens", "seconds", "timeouts", "errors"):
            self._sum_state(name)
        self.add_state("batches", default=torch.zeros((), dtype=_SUM), dist_reduce_fx=replicated)

    def update(self, *, tokens: float, seconds: float, timeouts: float, errors: float, batches: float) -> None:
        values = {"tokens": tokens, "seconds": seconds, "timeouts": timeouts, "errors": errors, "batches": batches}
        self._accumulate(**{name: torch.tensor(float(v), dtype=_SUM) for name, v in values.items()})

    def compute(self) -> dict[str, Tensor]:
        return {
            "rollout/tokens_per_s": self.tokens / self.seconds.clamp(min=1e-9),
            "generation_batches": self.batches,
            "verifier/timeouts": self.timeouts,
            "verifier/errors": self.errors,
        }
