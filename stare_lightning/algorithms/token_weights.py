"""The per-token weights of the policy loss: STARE's omega times the rollout-engine / trainer mismatch correction.

What it implements: each micro-batch's token weights are STARE's omega (Luo et al. 2026; docs/method.md
section 3), selected by ``step/selection.py``, times the importance-sampling correction of the rollout-engine /
trainer mismatch (``rollout_correction``). Both multiply the clipped surrogate after clipping.

With asynchronous rollouts (``rollout.max_staleness`` >= 1) the same correction is the off-policy one: the engine's
log-probs are the behaviour policy's (K versions back), and the old log-probs are always the trainer's own at the
step's start (the scoring pass or the update's first forward), which is what AReaL's decoupled PPO calls the
proximal policy. So the clip is taken against the proximal policy and the behaviour-to-proximal ratio is capped:
``mismatch.mode=truncate`` is truncated IS, ``mask`` drops tokens above the cap as AReaL's decoupled loss does.
STARE's gate reads the entropy of the current policy and its selection ranks by the current policy's surprisal,
because the gate's job is to hold the entropy of the policy being trained, not of the one that sampled; omega then
multiplies the importance weight, so it re-weights the corrected estimate of the current policy's gradient and
leaves the correction itself untouched.
"""

from __future__ import annotations

from torch import Tensor

from stare_lightning.algorithms.config_groups import MismatchConfig
from stare_lightning.algorithms.rollout_correction import mismatch_is_weights

__all__ = ["micro_batch_token_weights"]


def micro_batch_token_weights(
    mismatch: MismatchConfig,
    *,
    stare_omega: Tensor | None,
    mask: Tensor,
    old_logprobs: Tensor,
    rollout_logprobs: Tensor,
) -> Tensor | None:
    """The weights [B, T] of one micro-batch's per-token loss: omega times the IS correction (None: all ones)."""
    if not mismatch.enabled:
        return stare_omega
    # Truncated importance sampling of the engine/trainer mismatch (the engine sampled, the trainer learns).
    correction = mismatch_is_weights(
        old_logprobs,
        rollout_logprobs,
        mask,
        level=mismatch.correction,
        mode=mismatch.mode,
        cap=mismatch.cap,
    )
    return correction if stare_omega is None else stare_omega * correction
