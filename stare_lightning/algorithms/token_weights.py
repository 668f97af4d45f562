"""The per-token weights of the policy loss: STARE's omega, a step controller's weights by advantage sign, and the
rollout-engine / trainer mismatch correction.

What it implements: each micro-batch's token weights are STARE's omega (Luo et al. 2026; docs/method.md
section 3), selected by ``step/selection.py``, times the weights by advantage sign a step controller set for the
step (the PI controller, ``entropy_pi.py``; absent unless ``algorithm.entropy_control.name=pi``), times the
importance-sampling correction of the rollout-engine / trainer mismatch (``rollout_correction``). All multiply the
clipped surrogate after clipping.

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

import torch
from torch import Tensor

from stare_lightning.algorithms.config_groups import MismatchConfig
from stare_lightning.algorithms.entropy_controller import SignWeights
from stare_lightning.algorithms.rollout_correction import mismatch_is_weights
from stare_lightning.algorithms.surrogates import broadcast_advantages

__all__ = ["micro_batch_token_weights", "sign_token_weights"]

NO_SIGN_WEIGHTS = SignWeights()  # every weight 1: the loss is left as it is


def sign_token_weights(advantages: Tensor, like: Tensor, signs: SignWeights) -> Tensor:
    """float32 [B, T] shaped like ``like``: ``signs.positive`` where A > 0, ``signs.negative`` where A < 0, else 1."""
    adv = broadcast_advantages(advantages, like).detach()
    one = torch.ones((), dtype=torch.float32, device=adv.device)
    positive = torch.full((), signs.positive, dtype=torch.float32, device=adv.device)
    negative = torch.full((), signs.negative, dtype=torch.float32, device=adv.device)
    return torch.where(adv > 0, positive, torch.where(adv < 0, negative, one))


def micro_batch_token_weights(
    mismatch: MismatchConfig,
    *,
    stare_omega: Tensor | None,
    mask: Tensor,
    old_logprobs: Tensor,
    rollout_logprobs: Tensor,
    advantages: Tensor | None = None,
    signs: SignWeights = NO_SIGN_WEIGHTS,
) -> Tensor | None:
    """The weights [B, T] of one micro-batch's per-token loss: omega times the weights by advantage sign (read from
    ``advantages`` unless ``signs`` is neutral) times the IS correction (None: all ones)."""
    if not signs.neutral:
        by_sign = sign_token_weights(advantages, old_logprobs, signs)
        stare_omega = by_sign if stare_omega is None else stare_omega * by_sign
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
