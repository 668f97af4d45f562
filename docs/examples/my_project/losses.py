"""A policy loss: the importance-weighted policy gradient without a clip, -r A per token, r = pi / pi_old.

It is PPO's surrogate with the clip taken away, the baseline that shows what the clip does. The clip settings
(algorithm.policy_loss.clip_eps_low and clip_eps_high) are not used, and no token is ever counted as clipped.
"""

from __future__ import annotations

import torch

from stare_lightning.algorithms.policy_losses import POLICY_LOSSES, ClipRange
from stare_lightning.algorithms.surrogates import LOG_RATIO_CLAMP, SurrogateStats, broadcast_advantages


@POLICY_LOSSES.register("unclipped")
def unclipped_surrogate(logprobs, old_logprobs, advantages, mask, clip: ClipRange, token_weights=None):
    """Per-token loss [B, T] (0 at masked positions) and the clip counts (all 0)."""
    dtype = torch.promote_types(logprobs.dtype, torch.float32)
    valid = mask.to(torch.bool)
    adv = broadcast_advantages(advantages, logprobs).to(dtype)
    log_ratio = (logprobs.to(dtype) - old_logprobs.to(dtype)).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    loss = -adv * torch.exp(log_ratio)
    if token_weights is not None:  # STARE's weights (and the mismatch correction) scale each token's term
        loss = loss * token_weights.to(dtype)
    loss = torch.where(valid, loss, torch.zeros((), dtype=dtype, device=loss.device))
    zero = torch.zeros((), dtype=torch.float32, device=loss.device)
    counts = SurrogateStats(clip_low=zero, clip_high=zero, clip_dual=zero, tokens=valid.sum().to(torch.float32))
    return loss, counts
