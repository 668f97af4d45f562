"""Importance-sampling correction for the rollout-engine / trainer mismatch.

Rollouts come from an inference engine (vLLM, often bf16 with its own kernels) whose token probabilities
``pi_rollout`` differ slightly from the trainer's ``pi_train`` for the same weights, so nominally on-policy
updates are in fact slightly off-policy. Weighting each token's loss by ``pi_train / pi_rollout`` removes the
bias; the ratio is capped (truncated importance sampling, TIS) or outliers are dropped (masked importance
sampling) to bound the variance. References: Yao et al., "Your Efficient RL Framework Secretly Brings You
Off-Policy RL Training" (2025), which introduced TIS for this mismatch; Liu, Li et al., "When Speed Kills
Stability: Demystifying RL Collapse from the Training-Inference Mismatch" (2025), for the sequence-level and
masking variants; truncated importance weights go back to Retrace/V-trace (Munos et al. 2016; Espeholt et
al. 2018). The weights carry no gradient: they rescale the policy-gradient loss, they are not optimised.

Where this departs from those write-ups: only an upper cap (no lower bound), and masking returns a zero
weight for rejected tokens instead of a separate mask; callers that normalise by token count should count
``weights > 0`` when they want rejected tokens out of the denominator too.
"""

from __future__ import annotations

from typing import Literal

import torch

__all__ = ["MISMATCH_LEVELS", "MISMATCH_MODES", "mismatch_is_weights"]

MISMATCH_LEVELS = ("token", "sequence")
MISMATCH_MODES = ("truncate", "mask")

# exp() of a log-ratio beyond this would overflow fp32; any such ratio is far above every sensible cap.
_MAX_LOG_RATIO = 80.0


def mismatch_is_weights(
    trainer_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    level: Literal["token", "sequence"] = "token",
    mode: Literal["truncate", "mask"] = "truncate",
    cap: float = 2.0,
) -> torch.Tensor:
    """Per-token weights ``[batch, time]`` correcting for sampling from the rollout engine.

    ``level``, ``mode`` and ``cap`` are ``algorithm.mismatch.correction`` (when not ``none``), ``.mode`` and
    ``.cap``, checked by ``MismatchConfig`` (not here).

    Args:
        trainer_logprobs: log pi_train of the sampled tokens, ``[batch, time]``.
        rollout_logprobs: log pi_rollout reported by the engine, same shape.
        mask: 1 on response tokens, 0 on padding.
        level: ``"token"`` uses each token's ratio; ``"sequence"`` uses the product of a response's token
            ratios for all of its tokens.
        mode: ``"truncate"`` returns ``min(ratio, cap)``; ``"mask"`` returns the ratio where it is at most
            ``cap`` and 0 where it exceeds it (for ``"sequence"``, the whole response).
        cap: the ratio threshold (> 0).

    Returns:
        Detached weights, 0 on padding.
    """
    if trainer_logprobs.shape != rollout_logprobs.shape or trainer_logprobs.shape != mask.shape:
        raise ValueError(
            f"shapes differ: trainer {tuple(trainer_logprobs.shape)}, rollout {tuple(rollout_logprobs.shape)}, "
            f"mask {tuple(mask.shape)}"
        )
    if trainer_logprobs.dim() != 2:
        raise ValueError(f"expected [batch, time] tensors, got {trainer_logprobs.dim()} dimensions")

    valid = mask.to(torch.bool)
    log_ratio = (trainer_logprobs.detach().float() - rollout_logprobs.detach().float()).masked_fill(~valid, 0.0)
    if level == "sequence":
        log_ratio = log_ratio.sum(dim=-1, keepdim=True).expand_as(log_ratio)
    log_ratio = log_ratio.clamp(max=_MAX_LOG_RATIO)
    ratio = log_ratio.exp()
    if mode == "truncate":
        weights = ratio.clamp(max=cap)
    else:  # mask
        weights = torch.where(
            log_ratio <= torch.log(torch.tensor(cap, dtype=ratio.dtype)), ratio, torch.zeros_like(ratio)
        )
    return weights.masked_fill(~valid, 0.0)
