"""The per-token factors of the policy loss, assembled in one place.

What it implements: each micro-batch's token weights are STARE's omega (Luo et al. 2026; docs/method.md
section 3) times the importance-sampling correction of the rollout-engine / trainer mismatch
(``rollout_correction``). Both multiply the clipped surrogate after clipping. Where the selection scope
spans more than one micro-batch (``step``, ``sequence``, ``group``), omega is selected once per step
by ``step_selection`` before the first loss; with ``micro_batch`` it is selected here, inside each
micro-batch, from the current or the old log-probs (``stare.surprisal_source``).
Departure: with scope ``micro_batch`` the step-wide selection still runs, for the telemetry only.
"""

from __future__ import annotations

from torch import Tensor

from stare_lightning.algorithms.config import AlgorithmConfig
from stare_lightning.algorithms.rollout_correction import mismatch_is_weights
from stare_lightning.algorithms.stare import STAREStats, stare_weights_for_scope
from stare_lightning.algorithms.stare_controller import StepParams

__all__ = ["micro_batch_token_weights", "step_selection"]


def step_selection(
    logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    phi: Tensor | None,
    alg: AlgorithmConfig,
    params: StepParams,
    *,
    group_size: int,
) -> tuple[Tensor | None, STAREStats]:
    """STARE's selection over the whole step, gathered across ranks: (omega or None, its stats).

    omega is None when no STARE weight applies this step (STARE off or its gate closed). With scope
    ``micro_batch`` the selection is made over the step (the telemetry describes it) while the loss
    selects again inside each micro-batch.
    """
    stare = alg.stare
    scope = stare.scope if stare.scope != "micro_batch" else "step"
    omega, stats = stare_weights_for_scope(
        logprobs,
        advantages,
        mask,
        scope=scope,
        group_size=group_size,
        variant=stare.variant,
        top_ratio=stare.top_ratio,
        w=params.w,
        m=params.m,
        gate_on=True,
        selector=stare.selector,
        sensitivity=phi,
    )
    return (omega if stare.enabled and params.gate_on else None), stats


def micro_batch_token_weights(
    alg: AlgorithmConfig,
    *,
    advantages: Tensor,
    mask: Tensor,
    current_logprobs: Tensor,
    old_logprobs: Tensor,
    rollout_logprobs: Tensor,
    step_omega: Tensor | None,
    params: StepParams | None,
    phi: Tensor | None,
) -> Tensor | None:
    """The weights [B, T] of one micro-batch's per-token loss, or None when every weight is 1.

    ``step_omega``: this micro-batch's slice of ``step_selection``'s omega (scopes other than
    ``micro_batch``); ``params``: the step's gate and W/M (needed for scope ``micro_batch``).
    """
    stare = alg.stare
    weights = step_omega if stare.scope != "micro_batch" else None
    if stare.enabled and stare.scope == "micro_batch":
        source = current_logprobs if stare.surprisal_source == "current" else old_logprobs
        weights, _ = stare_weights_for_scope(
            source.detach(),
            advantages,
            mask,
            scope="micro_batch",
            variant=stare.variant,
            top_ratio=stare.top_ratio,
            w=params.w,
            m=params.m,
            gate_on=params.gate_on,
            selector=stare.selector,
            sensitivity=phi,
        )
    if alg.mismatch_correction != "none":
        # Truncated importance sampling of the engine/trainer mismatch (the engine sampled, the trainer learns).
        correction = mismatch_is_weights(
            old_logprobs,
            rollout_logprobs,
            mask,
            level=alg.mismatch_correction,
            mode=alg.mismatch_mode,
            cap=alg.mismatch_cap,
        )
        weights = correction if weights is None else weights * correction
    return weights
