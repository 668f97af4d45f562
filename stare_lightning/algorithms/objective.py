"""The policy loss of one micro-batch: entropy control, surrogate with token weights, KL and entropy terms.

What it implements, in this order (docs/method.md, sections 3 and 4):
1. the entropy control, by name from ``ENTROPY_CONTROLS`` (Cui et al. 2025 Clip-Cov / KL-Cov; Wang et al.
   2025 80/20 rule): the selected tokens' log-probs are detached (Clip-Cov: the drawn high-covariance tokens;
   80/20: all but the top-entropy tokens), which zeroes their policy gradient and keeps the loss value, or a
   per-token penalty is added (KL-Cov);
2. the surrogate, by name from ``policy_losses.POLICY_LOSSES`` (PPO's clipped ratio with clip-higher and
   dual clip, GSPO, CISPO), multiplied AFTER clipping by the token weights (STARE's omega; Luo et al. 2026,
   arXiv 2606.19236); the entropy control's penalty is then added;
3. aggregation with the step-global `LossNormalizer`, so the micro-batch losses sum to the step loss;
4. + kl.coef * (the KL estimator against the reference policy, aggregated the same way);
5. - the entropy bonus's coefficient * (the entropy bonus, aggregated the same way).
What it reads of the algorithm is a ``LossSpec``: the policy loss, entropy control and KL sub-groups, the
aggregation and the fixed entropy coefficient.
With no token weights (or all ones) and no extras this is plain GRPO/PPO, bit for bit.

Departure: KL-Cov follows Cui et al., whose loss replaces the PPO clip by the KL penalty, so with
entropy_control.name = "kl_cov" the surrogate is the unclipped ratio times A (clip settings unused).
Clip-Cov keeps the PPO clip and draws only among tokens whose clip is not already active.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from stare_lightning.algorithms.config import AlgorithmConfig
from stare_lightning.algorithms.config_groups import EntropyControlConfig, KLConfig, PolicyLossConfig
from stare_lightning.algorithms.entropy_control import ENTROPY_CONTROLS
from stare_lightning.algorithms.policy_losses import POLICY_LOSSES, ClipRange
from stare_lightning.algorithms.surrogates import (
    LOG_RATIO_CLAMP,
    LossNormalizer,
    aggregate_loss,
    broadcast_advantages,
    entropy_bonus,
    kl_penalty,
)

__all__ = ["LossSpec", "policy_loss"]


@dataclass(frozen=True)
class LossSpec:
    """What ``policy_loss`` reads of the algorithm."""

    policy_loss: PolicyLossConfig
    entropy_control: EntropyControlConfig
    kl: KLConfig
    aggregation: str  # a mode of ``aggregate_loss``: the surrogate, KL and entropy terms alike
    entropy_coef: float  # the fixed entropy-bonus coefficient (an adaptive one is passed per call)

    @classmethod
    def of(cls, algorithm: AlgorithmConfig) -> LossSpec:
        return cls(
            policy_loss=algorithm.policy_loss,
            entropy_control=algorithm.entropy_control,
            kl=algorithm.kl,
            aggregation=algorithm.update.loss_agg,
            entropy_coef=algorithm.entropy_bonus.coef,
        )

    @property
    def clip(self) -> ClipRange:
        loss = self.policy_loss
        return ClipRange(loss.clip_eps_low, loss.clip_eps_high, loss.dual_clip_c)


def _valid_sum(x: Tensor, valid: Tensor) -> Tensor:
    """Detached float32 sum of x over the valid positions (garbage elsewhere never leaks)."""
    return torch.where(valid, x.detach(), torch.zeros((), dtype=x.dtype, device=x.device)).sum().to(torch.float32)


def policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    spec: LossSpec,
    normalizer: LossNormalizer,
    *,
    token_weights: Tensor | None = None,
    ref_logprobs: Tensor | None = None,
    entropy: Tensor | None = None,
    entropy_coef: float | None = None,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """(loss, stats) of one micro-batch.

    logprobs: [B, T] with gradient; old_logprobs: [B, T] (detached current ones when on-policy);
    advantages: [B] or [B, T]; mask: [B, T]; token_weights: STARE weights [B, T] or None;
    ref_logprobs: needed when spec.kl.coef > 0; entropy: [B, T] with gradient, needed for an entropy
    bonus and for entropy control "top_entropy"; entropy_coef: the coefficient to use this step
    (None: spec.entropy_coef; pass the adaptive value when the bonus has a target);
    generator: the random draw of Clip-Cov.

    stats (detached 0-d float32 tensors, SUMS over this micro-batch's valid tokens, so callers add them
    over micro-batches and ranks and divide by global counts): tokens, clip_low, clip_high, clip_dual,
    controlled (tokens detached or penalised by the entropy control), pg_loss (this micro-batch's
    share of the aggregated surrogate), ratio_sum, and when the inputs exist kl_sum, kl_loss,
    entropy_sum, entropy_loss, weight_sum.
    """
    entropy_coef = spec.entropy_coef if entropy_coef is None else entropy_coef
    adv = broadcast_advantages(advantages, logprobs)
    valid = mask.to(torch.bool)
    chosen = spec.entropy_control
    control = ENTROPY_CONTROLS[chosen.name](
        chosen.settings(), spec.clip, logprobs, old_logprobs, adv, mask, entropy, generator
    )
    detach = control.detach
    lp_surrogate = logprobs if detach is None else torch.where(detach, logprobs.detach(), logprobs)
    clip = ClipRange(1.0, math.inf) if control.unclipped else spec.clip
    surrogate = POLICY_LOSSES[spec.policy_loss.name]
    per_token, clip_stats = surrogate(lp_surrogate, old_logprobs, adv, mask, clip, token_weights=token_weights)
    if control.penalty is not None:
        per_token = per_token + control.penalty
    controlled = control.controlled if control.controlled is not None else detach
    pg_loss = aggregate_loss(per_token, mask, spec.aggregation, normalizer)
    loss, stats = _add_regularizers(pg_loss, logprobs, mask, spec, normalizer, ref_logprobs, entropy, entropy_coef)
    stats.update(_surrogate_stats(logprobs, old_logprobs, valid, clip_stats, controlled, pg_loss, token_weights))
    return loss, stats


def _add_regularizers(
    loss: Tensor,
    logprobs: Tensor,
    mask: Tensor,
    spec: LossSpec,
    normalizer: LossNormalizer,
    ref_logprobs: Tensor | None,
    entropy: Tensor | None,
    entropy_coef: float,
) -> tuple[Tensor, dict[str, Tensor]]:
    """``loss`` + kl coef * KL - entropy_coef * entropy bonus, each aggregated like the surrogate."""
    valid, stats, kl_coef = mask.to(torch.bool), {}, spec.kl.coef
    if kl_coef > 0 and ref_logprobs is None:
        raise ValueError(f"ref_logprobs=None is not allowed with kl coef={kl_coef}: pass the reference log-probs")
    if ref_logprobs is not None:
        kl = kl_penalty(logprobs, ref_logprobs, spec.kl.estimator)
        kl_loss = aggregate_loss(kl, mask, spec.aggregation, normalizer)
        if kl_coef > 0:
            loss = loss + kl_coef * kl_loss
        stats.update(kl_sum=_valid_sum(kl, valid), kl_loss=kl_loss.detach().float())
    if entropy_coef != 0 and entropy is None:
        raise ValueError(f"entropy=None is not allowed with entropy_coef={entropy_coef}: pass per-token entropy")
    if entropy is not None:
        bonus = entropy_bonus(entropy, mask)
        ent_loss = aggregate_loss(bonus, mask, spec.aggregation, normalizer)
        if entropy_coef != 0:
            loss = loss - entropy_coef * ent_loss
        stats.update(entropy_sum=bonus.sum().detach().float(), entropy_loss=ent_loss.detach().float())
    return loss, stats


def _surrogate_stats(
    logprobs, old_logprobs, valid, clip_stats, controlled, pg_loss, token_weights
) -> dict[str, Tensor]:
    f32 = torch.float32
    with torch.no_grad():
        ratio = torch.exp((logprobs.detach() - old_logprobs.detach()).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
        stats = {
            "tokens": clip_stats.tokens,
            "clip_low": clip_stats.clip_low,
            "clip_high": clip_stats.clip_high,
            "clip_dual": clip_stats.clip_dual,
            "controlled": (
                torch.zeros((), dtype=f32, device=logprobs.device)
                if controlled is None
                else (controlled & valid).sum().to(f32)
            ),
            "pg_loss": pg_loss.detach().to(f32),
            "ratio_sum": _valid_sum(ratio, valid),
        }
        if token_weights is not None:
            stats["weight_sum"] = _valid_sum(token_weights, valid)
    return stats
