"""Group-relative advantages, zero-variance group detection and DAPO's overlong reward shaping.

What it implements:
- GRPO (Shao et al. 2024, DeepSeekMath): A_i = (r_i - mean(r)) / (std(r) + eps) within each group of
  G responses to one prompt. `std` is the UNBIASED sample standard deviation (divisor G - 1), as in
  the common open implementations; a group of one has std 0 and advantage 0.
- Dr.GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training"): A_i = r_i - mean(r), no std.
- RLOO (Ahmadian et al. 2024): A_i = r_i - mean of the other G - 1 rewards = G / (G - 1) (r_i - mean(r)).
- Dynamic sampling support (DAPO, Yu et al. 2025): `zero_variance_groups` flags groups whose rewards
  are all exactly equal (their GRPO advantages are all zero).
- DAPO's soft overlong punishment: 0 up to L_max - L_cache, then linear down to -penalty_factor at
  L_max, and -penalty_factor beyond.

Departure from the papers: none; eps is added to the std (not under a square root).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from stare_lightning.algorithms.registry import Registry

__all__ = ["ADVANTAGE_ESTIMATORS", "compute_advantages", "zero_variance_groups", "overlong_penalty"]

# An estimator maps rewards [P, G] (float32 or wider) and eps to advantages [P, G].
ADVANTAGE_ESTIMATORS: Registry[Callable[[Tensor, float], Tensor]] = Registry("algorithm.advantage.name")


def _check_rewards(rewards: Tensor) -> None:
    if rewards.dim() != 2:
        raise ValueError(f"rewards has shape {tuple(rewards.shape)}; expected [P, G] (prompts x responses)")


def compute_advantages(rewards: Tensor, estimator: str = "grpo", eps: float = 1e-6) -> Tensor:
    """Per-response advantages [P, G] from rewards [P, G], float32 (float64 stays float64)."""
    _check_rewards(rewards)
    estimate = ADVANTAGE_ESTIMATORS[estimator]
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not (math.isfinite(eps) and eps >= 0):
        raise ValueError(f"eps={eps!r} is out of range: must be a finite number >= 0")
    return estimate(rewards.to(torch.promote_types(rewards.dtype, torch.float32)), eps)


@ADVANTAGE_ESTIMATORS.register("grpo")
def grpo_advantages(rewards: Tensor, eps: float) -> Tensor:
    group = rewards.shape[1]
    if group < 2:
        return torch.zeros_like(rewards)
    std = rewards.std(dim=1, keepdim=True, correction=1)
    return (rewards - rewards.mean(dim=1, keepdim=True)) / (std + eps)


@ADVANTAGE_ESTIMATORS.register("dr_grpo")
def dr_grpo_advantages(rewards: Tensor, eps: float) -> Tensor:
    return rewards - rewards.mean(dim=1, keepdim=True)


@ADVANTAGE_ESTIMATORS.register("rloo")
def rloo_advantages(rewards: Tensor, eps: float) -> Tensor:
    group = rewards.shape[1]
    if group < 2:
        raise ValueError(f"rewards has group size G={group}; estimator 'rloo' needs G >= 2")
    return (rewards - rewards.mean(dim=1, keepdim=True)) * (group / (group - 1))


def zero_variance_groups(rewards: Tensor) -> Tensor:
    """Bool [P]: True where every reward of the group equals the first one exactly."""
    _check_rewards(rewards)
    if rewards.shape[1] == 0:
        return torch.ones(rewards.shape[0], dtype=torch.bool, device=rewards.device)
    return (rewards == rewards[:, :1]).all(dim=1)


def overlong_penalty(
    response_lengths: Tensor,
    max_response_length: int,
    buffer_length: int,
    penalty_factor: float = 1.0,
) -> Tensor:
    """DAPO soft overlong punishment per response (<= 0), to be ADDED to the reward.

    With L = max_response_length and C = buffer_length: 0 for length <= L - C;
    -penalty_factor * (length - (L - C)) / C for L - C < length <= L; -penalty_factor beyond L.
    buffer_length = 0 gives 0 up to L and -penalty_factor beyond (a hard cut).
    """
    if isinstance(max_response_length, bool) or not isinstance(max_response_length, int) or max_response_length < 1:
        raise ValueError(f"max_response_length={max_response_length!r} is out of range: must be an integer >= 1")
    if (
        isinstance(buffer_length, bool)
        or not isinstance(buffer_length, int)
        or not 0 <= buffer_length <= max_response_length
    ):
        raise ValueError(
            f"buffer_length={buffer_length!r} is out of range: must be an integer in [0, max_response_length="
            f"{max_response_length}]"
        )
    if (
        isinstance(penalty_factor, bool)
        or not isinstance(penalty_factor, (int, float))
        or not (math.isfinite(penalty_factor) and penalty_factor >= 0)
    ):
        raise ValueError(f"penalty_factor={penalty_factor!r} is out of range: must be a finite number >= 0")
    lengths = response_lengths.to(torch.float32)
    expected = max_response_length - buffer_length
    if buffer_length == 0:
        over = (lengths > max_response_length).to(torch.float32)
        return -penalty_factor * over
    frac = ((lengths - expected) / buffer_length).clamp(min=0.0, max=1.0)
    return -penalty_factor * frac
