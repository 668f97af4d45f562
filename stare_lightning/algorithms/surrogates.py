"""PPO clipped surrogate, loss aggregation across micro-batches, KL estimators and the entropy bonus.

What it implements:
- The PPO clipped objective (Schulman et al. 2017) with separate lower and upper clip ranges
  (clip-higher, DAPO, Yu et al. 2025) and the optional dual clip (Ye et al. 2020, "Mastering
  Complex Control in MOBA Games"): for A < 0 the per-token loss is capped at -A * c, c > 1.
  Per-token loss: max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high)), then min(., -A c) where A < 0,
  then multiplied by the token weight (STARE's omega) AFTER clipping.
- Aggregation modes, each normalised by counts of the WHOLE optimizer step (`LossNormalizer`), so
  that the losses of the micro-batches, summed, equal the loss of the step's batch in one piece:
    token-mean               sum of all valid per-token losses / num_tokens
    seq-mean-token-mean      sum over sequences of (the sequence's token-mean) / num_sequences
    seq-mean-token-sum-norm  sum of all valid per-token losses / (num_sequences * max_response_length)
                             (Dr.GRPO: per-sequence sums over a constant length, averaged over sequences)
  A count of zero is treated as one (the loss is then 0), never as a division by zero.
- KL estimators of KL(pi || pi_ref) per token (Schulman, "Approximating KL divergence", 2020), with
  d = log pi_ref - log pi: k1 = -d, k2 = d^2 / 2, k3 = exp(d) - d - 1.
- The entropy bonus per token.

Departures: the log-ratios log pi - log pi_old and log pi_ref - log pi are clamped to [-20, 20]
before exponentiation, for numerical safety only (exp(20) ~ 5e8; the gradient is zero beyond).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "AGGREGATION_MODES",
    "KL_ESTIMATORS",
    "LOG_RATIO_CLAMP",
    "LossNormalizer",
    "SurrogateStats",
    "aggregate_loss",
    "broadcast_advantages",
    "clip_masks",
    "clipped_surrogate",
    "entropy_bonus",
    "kl_penalty",
]

AGGREGATION_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
KL_ESTIMATORS = ("k1", "k2", "k3")
LOG_RATIO_CLAMP = 20.0

Count = int | float | Tensor


@dataclass
class LossNormalizer:
    """Counts over the whole optimizer step (all micro-batches, all ranks).

    num_tokens: valid response tokens; num_sequences: sequences with at least one valid token;
    max_response_length: the constant length of `seq-mean-token-sum-norm` (needed by that mode only).
    Counts may be Python numbers or 0-d tensors (e.g. after an all-reduce); they come from masks, so only
    their shape is checked here.
    """

    num_tokens: Count
    num_sequences: Count
    max_response_length: int | None = None

    def __post_init__(self) -> None:
        for name in ("num_tokens", "num_sequences"):
            value = getattr(self, name)
            if isinstance(value, Tensor) and value.numel() != 1:
                raise ValueError(f"{name} has shape {tuple(value.shape)}; expected a scalar count")

    @classmethod
    def from_mask(cls, mask: Tensor, max_response_length: int | None = None) -> LossNormalizer:
        """Counts of one [B, T] mask, as Python ints (sum them over micro-batches and ranks for a step)."""
        valid = mask.to(torch.bool)
        return cls(
            num_tokens=int(valid.sum()),
            num_sequences=int(valid.any(dim=-1).sum()) if valid.numel() else 0,
            max_response_length=max_response_length,
        )


@dataclass
class SurrogateStats:
    """Counts over the valid tokens given (float32 0-d tensors, so they sum across micro-batches and ranks).

    clip_low: A < 0 and r < 1 - eps_low (lower clip active, zero gradient);
    clip_high: A > 0 and r > 1 + eps_high (upper clip active, zero gradient);
    clip_dual: A < 0 and r > c (dual clip active, zero gradient); tokens: valid tokens.
    """

    clip_low: Tensor
    clip_high: Tensor
    clip_dual: Tensor
    tokens: Tensor


def broadcast_advantages(advantages: Tensor, like: Tensor) -> Tensor:
    """[B] or [B, T] advantages as [B, T] (a view when broadcasting)."""
    if advantages.dim() == 1:
        if advantages.shape[0] != like.shape[0]:
            raise ValueError(
                f"advantages has shape {tuple(advantages.shape)}; expected [{like.shape[0]}] or {list(like.shape)}"
            )
        return advantages.unsqueeze(1).expand_as(like)
    if advantages.shape != like.shape:
        raise ValueError(f"advantages has shape {tuple(advantages.shape)}; expected [B] or {list(like.shape)}")
    return advantages


def _check_pair(name: str, x: Tensor, like: Tensor) -> None:
    if x.shape != like.shape:
        raise ValueError(f"{name} has shape {tuple(x.shape)}; expected {tuple(like.shape)}")


def clip_masks(
    ratio: Tensor, advantages: Tensor, valid: Tensor, eps_low: float, eps_high: float
) -> tuple[Tensor, Tensor]:
    """Valid tokens where the PPO clip removes the gradient: low, A < 0 and r < 1 - eps_low; high,
    A > 0 and r > 1 + eps_high. ``advantages`` are per token [B, T], like ``ratio``."""
    low = valid & (advantages < 0) & (ratio < 1.0 - eps_low)
    high = valid & (advantages > 0) & (ratio > 1.0 + eps_high)
    return low, high


def clipped_surrogate(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    eps_low: float,
    eps_high: float,
    dual_clip_c: float | None = None,
    token_weights: Tensor | None = None,
) -> tuple[Tensor, SurrogateStats]:
    """Per-token PPO loss [B, T] (0 at masked positions) and clip counts.

    eps_low in [0, 1] (1 disables the lower clip since r >= 0); eps_high >= 0 (inf disables the upper
    clip); dual_clip_c None or a finite number > 1. token_weights [B, T] multiply the clipped loss.
    The scalars are not checked here: `PolicyLossConfig` checks algorithm.policy_loss.clip_eps_* / dual_clip_c.
    """
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs has shape {tuple(logprobs.shape)}; expected [B, T]")
    _check_pair("old_logprobs", old_logprobs, logprobs)
    _check_pair("mask", mask, logprobs)
    if token_weights is not None:
        _check_pair("token_weights", token_weights, logprobs)
    adv = broadcast_advantages(advantages, logprobs)
    dtype = torch.promote_types(logprobs.dtype, torch.float32)
    adv = adv.to(dtype)
    valid = mask.to(torch.bool)
    log_ratio = (logprobs.to(dtype) - old_logprobs.to(dtype)).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    loss = torch.maximum(unclipped, clipped)
    with torch.no_grad():
        r = ratio.detach()
        low, high = clip_masks(r, adv, valid, eps_low, eps_high)
        clip_low, clip_high = low.sum().to(torch.float32), high.sum().to(torch.float32)
        if dual_clip_c is not None:
            clip_dual = (valid & (adv < 0) & (r > dual_clip_c)).sum().to(torch.float32)
        else:
            clip_dual = torch.zeros((), dtype=torch.float32, device=logprobs.device)
        tokens = valid.sum().to(torch.float32)
    if dual_clip_c is not None:
        loss = torch.where(adv < 0, torch.minimum(loss, -adv * dual_clip_c), loss)
    if token_weights is not None:
        loss = loss * token_weights.to(dtype)
    loss = torch.where(valid, loss, torch.zeros((), dtype=dtype, device=loss.device))
    return loss, SurrogateStats(clip_low=clip_low, clip_high=clip_high, clip_dual=clip_dual, tokens=tokens)


def _as_count(value: Count, like: Tensor) -> Tensor:
    if isinstance(value, Tensor):
        return value.to(device=like.device, dtype=like.dtype).reshape(())
    return torch.tensor(float(value), dtype=like.dtype, device=like.device)


def aggregate_loss(per_token_loss: Tensor, mask: Tensor, mode: str, normalizer: LossNormalizer) -> Tensor:
    """Scalar loss of one micro-batch under the step-global `normalizer` (see module doc).

    `mode` is one of AGGREGATION_MODES (algorithm.update.loss_agg, checked by `UpdateConfig`).
    """
    if per_token_loss.dim() != 2:
        raise ValueError(f"per_token_loss has shape {tuple(per_token_loss.shape)}; expected [B, T]")
    _check_pair("mask", mask, per_token_loss)
    valid = mask.to(torch.bool)
    zero = torch.zeros((), dtype=per_token_loss.dtype, device=per_token_loss.device)
    masked = torch.where(valid, per_token_loss, zero)
    if mode == "token-mean":
        return masked.sum() / _as_count(normalizer.num_tokens, masked).clamp(min=1)
    num_seq = _as_count(normalizer.num_sequences, masked).clamp(min=1)
    if mode == "seq-mean-token-mean":
        per_seq = masked.sum(dim=-1) / valid.sum(dim=-1).clamp(min=1).to(masked.dtype)
        return per_seq.sum() / num_seq
    # seq-mean-token-sum-norm
    if normalizer.max_response_length is None:
        raise ValueError(
            "normalizer.max_response_length=None is not allowed with mode 'seq-mean-token-sum-norm': "
            "give the constant length (an integer >= 1)"
        )
    return masked.sum() / (num_seq * normalizer.max_response_length)


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, estimator: str = "k3") -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) from sampled-token log-probs (see module doc).

    `estimator` is one of KL_ESTIMATORS (algorithm.kl.estimator, checked by `KLConfig`).
    """
    _check_pair("ref_logprobs", ref_logprobs, logprobs)
    dtype = torch.promote_types(logprobs.dtype, torch.float32)
    d = ref_logprobs.to(dtype) - logprobs.to(dtype)
    if estimator == "k1":
        return -d
    if estimator == "k2":
        return 0.5 * d * d
    # k3
    d = d.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return torch.exp(d) - d - 1.0


def entropy_bonus(entropy: Tensor, mask: Tensor) -> Tensor:
    """Per-token entropy at valid positions, 0 elsewhere: the bonus a loss SUBTRACTS (times its coefficient)."""
    _check_pair("mask", mask, entropy)
    return torch.where(mask.to(torch.bool), entropy, torch.zeros((), dtype=entropy.dtype, device=entropy.device))
