"""Policy losses (surrogates) by name: PPO's clipped ratio, GSPO's sequence-level ratio, CISPO's clipped IS weight.

Each returns the per-token loss ``[B, T]`` (0 at masked positions) that ``aggregate_loss`` then reduces, and the
clip counts. Every one multiplies its per-token loss by the token weights (STARE's omega, the mismatch IS
correction) after its own clipping, so a token weight scales that token's gradient and nothing else.

- ``ppo`` (Schulman et al. 2017; clip-higher and dual clip): ``surrogates.clipped_surrogate``.
- ``gspo`` (Zheng et al. 2025, "Group Sequence Policy Optimization"): the ratio of a sequence is the geometric
  mean of its token ratios, s_i = exp(mean_t log(pi / pi_old)), clipped to [1 - eps_low, 1 + eps_high] as PPO
  clips a token's. It is written in the paper's token form s_it = sg(s_i) pi_t / sg(pi_t): every token of
  sequence i carries the value s_i and the gradient s_i grad log pi_t, so under ``seq-mean-token-mean`` the loss
  and its gradient are exactly the sequence-level objective -mean_i min(s_i A_i, clip(s_i) A_i).
  With STARE: the weight omega_t multiplies token t's term after the clip, so sequence i's gradient becomes
  s_i A_i mean_t(omega_t grad log pi_t). The sequence ratio, and whether it is clipped, stay those of the
  unweighted sequence: the ratio measures how far the whole sequence moved (the trust region), while STARE's
  argument is about which tokens' gradients move the entropy (its dH is a sum over tokens of omega A Phi).
- ``cispo`` (MiniMax 2025, "MiniMax-M1"): the loss -sg(clip(r_t, 1 - eps_low, 1 + eps_high)) A log pi_t. The
  IS weight is clipped and detached, so no token loses its gradient (PPO zeroes clipped tokens'); the recipe
  sets eps_low = 1, i.e. no lower bound, as the paper does. With STARE: -omega_t sg(clip(r_t)) A log pi_t, omega
  scaling the token's gradient as it does in PPO. Its clip counts are the tokens whose weight was clipped (their
  gradient is kept, only bounded).

Departures: GSPO and CISPO log-ratios are clamped to [-20, 20] before exponentiation, as PPO's are.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from stare_lightning.algorithms.registry import Registry
from stare_lightning.algorithms.surrogates import (
    LOG_RATIO_CLAMP,
    SurrogateStats,
    broadcast_advantages,
    clip_masks,
    clipped_surrogate,
)

__all__ = ["POLICY_LOSSES", "ClipRange", "cispo_surrogate", "gspo_surrogate", "ppo_surrogate"]


@dataclass(frozen=True)
class ClipRange:
    """The clip of a policy loss: its ratio (or IS weight) is held in [1 - low, 1 + high]; ``dual`` is PPO's
    dual-clip constant (None: off)."""

    low: float
    high: float
    dual: float | None = None


PolicyLoss = Callable[..., tuple[Tensor, SurrogateStats]]
POLICY_LOSSES: Registry[PolicyLoss] = Registry("algorithm.policy_loss.name")


def _prepared(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor):
    if logprobs.shape != old_logprobs.shape or logprobs.shape != mask.shape:
        raise ValueError(
            f"logprobs {tuple(logprobs.shape)}, old_logprobs {tuple(old_logprobs.shape)} and mask "
            f"{tuple(mask.shape)} must have one [B, T] shape"
        )
    dtype = torch.promote_types(logprobs.dtype, torch.float32)
    adv = broadcast_advantages(advantages, logprobs).to(dtype)
    return dtype, adv, mask.to(torch.bool)


def _finish(loss: Tensor, token_weights: Tensor | None, valid: Tensor) -> Tensor:
    if token_weights is not None:
        if token_weights.shape != loss.shape:
            raise ValueError(f"token_weights has shape {tuple(token_weights.shape)}; expected {tuple(loss.shape)}")
        loss = loss * token_weights.to(loss.dtype)
    return torch.where(valid, loss, torch.zeros((), dtype=loss.dtype, device=loss.device))


def _counts(low: Tensor, high: Tensor, valid: Tensor) -> SurrogateStats:
    f32 = torch.float32
    zero = torch.zeros((), dtype=f32, device=valid.device)
    return SurrogateStats(
        clip_low=low.sum().to(f32), clip_high=high.sum().to(f32), clip_dual=zero, tokens=valid.sum().to(f32)
    )


@POLICY_LOSSES.register("ppo")
def ppo_surrogate(logprobs, old_logprobs, advantages, mask, clip: ClipRange, token_weights=None):
    """PPO's clipped surrogate per token (``surrogates.clipped_surrogate``)."""
    return clipped_surrogate(
        logprobs,
        old_logprobs,
        advantages,
        mask,
        eps_low=clip.low,
        eps_high=clip.high,
        dual_clip_c=clip.dual,
        token_weights=token_weights,
    )


@POLICY_LOSSES.register("gspo")
def gspo_surrogate(logprobs, old_logprobs, advantages, mask, clip: ClipRange, token_weights=None):
    """GSPO's sequence-ratio surrogate in token form (module docstring); advantages are per sequence."""
    dtype, adv, valid = _prepared(logprobs, old_logprobs, advantages, mask)
    zero = torch.zeros((), dtype=dtype, device=logprobs.device)
    token_log_ratio = torch.where(valid, logprobs.to(dtype) - old_logprobs.to(dtype), zero)
    sequence_log_ratio = token_log_ratio.sum(-1) / valid.sum(-1).clamp(min=1).to(dtype)
    lp = logprobs.to(dtype)
    log_s = (sequence_log_ratio.detach()[:, None] + lp - lp.detach()).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    s = torch.exp(log_s)
    loss = torch.maximum(-adv * s, -adv * s.clamp(1.0 - clip.low, 1.0 + clip.high))
    with torch.no_grad():
        low, high = clip_masks(s.detach(), adv, valid, clip.low, clip.high)
    return _finish(loss, token_weights, valid), _counts(low, high, valid)


@POLICY_LOSSES.register("cispo")
def cispo_surrogate(logprobs, old_logprobs, advantages, mask, clip: ClipRange, token_weights=None):
    """CISPO's clipped, detached IS weight times the log-prob, per token (module docstring)."""
    dtype, adv, valid = _prepared(logprobs, old_logprobs, advantages, mask)
    lp = logprobs.to(dtype)
    ratio = torch.exp((lp.detach() - old_logprobs.to(dtype)).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    weight = ratio.clamp(1.0 - clip.low, 1.0 + clip.high)
    loss = -adv * weight * lp
    low, high = valid & (ratio < 1.0 - clip.low), valid & (ratio > 1.0 + clip.high)
    return _finish(loss, token_weights, valid), _counts(low, high, valid)
