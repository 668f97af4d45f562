"""The per-token factors of the policy loss, assembled in one place, and when STARE's selection is made.

What it implements: each micro-batch's token weights are STARE's omega (Luo et al. 2026; docs/method.md
section 3) times the importance-sampling correction of the rollout-engine / trainer mismatch
(``rollout_correction``). Both multiply the clipped surrogate after clipping.

When omega is selected (``selection_timing``), from ``stare.scope`` and ``stare.surprisal_source``:
- ``micro_batch``: inside each micro-batch's forward, from its current (detached) or old log-probs. Scope
  ``micro_batch`` always; scope ``sequence`` with the current log-probs (a row's selection needs only that row).
- ``optimizer_step``: scopes ``step`` and ``group`` with the current log-probs: once before the first
  optimizer step from the scoring pass (the policy has not moved yet), then again before every later
  optimizer step (PPO epochs, mini-batches) from a no-grad pass of the updated policy over the step's batch.
- ``step``: the old log-probs: one selection from the scoring pass, kept for every optimizer step.
The paper ranks the current policy's surprisal; its reference code re-selects per micro-batch.
"""

from __future__ import annotations

from enum import StrEnum

from torch import Tensor

from stare_lightning.algorithms.config import AlgorithmConfig, STAREConfig
from stare_lightning.algorithms.rollout_correction import mismatch_is_weights
from stare_lightning.algorithms.stare import STAREStats, stare_weights_for_scope
from stare_lightning.algorithms.stare_controller import StepParams

__all__ = [
    "SelectionTiming",
    "micro_batch_stare_weights",
    "micro_batch_token_weights",
    "selection_timing",
    "step_selection",
]


class SelectionTiming(StrEnum):
    """When the selection that the loss applies is made (module docstring)."""

    STEP = "step"
    OPTIMIZER_STEP = "optimizer_step"
    MICRO_BATCH = "micro_batch"


def selection_timing(stare: STAREConfig) -> SelectionTiming:
    """When the selection that the loss applies is made, from ``stare.scope`` and ``stare.surprisal_source``.

    With STARE off it is ``STEP``: the step-wide selection is still made, for the telemetry only.
    """
    if not stare.enabled:
        return SelectionTiming.STEP
    current = stare.surprisal_source == "current"
    if stare.scope == "micro_batch" or (stare.scope == "sequence" and current):
        return SelectionTiming.MICRO_BATCH
    if current and stare.scope in ("step", "group"):
        return SelectionTiming.OPTIMIZER_STEP
    return SelectionTiming.STEP


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
    """STARE's selection over the whole batch given, gathered across ranks: (omega or None, its stats).

    omega is None when no STARE weight applies (STARE off or its gate closed). Not for timing
    ``micro_batch``, whose selection is made inside the loss.
    """
    stare = alg.stare
    omega, stats = stare_weights_for_scope(
        logprobs,
        advantages,
        mask,
        scope=stare.scope if stare.scope != "micro_batch" else "step",
        group_size=group_size,
        variant=stare.variant,
        top_ratio=stare.top_ratio,
        w=params.w,
        m=params.m,
        gate_on=True,
        selector=stare.selector,
        k_rounding=stare.k_rounding,
        tie_order=stare.tie_order,
        sensitivity=phi,
    )
    return (omega if stare.enabled and params.gate_on else None), stats


def micro_batch_stare_weights(
    alg: AlgorithmConfig,
    *,
    advantages: Tensor,
    mask: Tensor,
    current_logprobs: Tensor,
    old_logprobs: Tensor,
    step_omega: Tensor | None,
    step_selected: Tensor | None,
    params: StepParams,
    phi: Tensor | None,
) -> tuple[Tensor | None, Tensor | None]:
    """STARE's omega [B, T] for one micro-batch (None: all ones) and the tokens selected (None: no selection).

    ``step_omega``, ``step_selected``: this micro-batch's slice of the step-wide selection (timings
    ``step`` and ``optimizer_step``), returned as they are; with timing ``micro_batch`` the selection is
    made here.
    """
    stare = alg.stare
    if selection_timing(stare) is not SelectionTiming.MICRO_BATCH:
        return step_omega, step_selected
    source = current_logprobs if stare.surprisal_source == "current" else old_logprobs
    omega, stats = stare_weights_for_scope(
        source.detach(),
        advantages,
        mask,
        scope=stare.scope,
        variant=stare.variant,
        top_ratio=stare.top_ratio,
        w=params.w,
        m=params.m,
        gate_on=params.gate_on,
        selector=stare.selector,
        k_rounding=stare.k_rounding,
        tie_order=stare.tie_order,
        sensitivity=phi,
    )
    return (omega if params.gate_on else None), stats.selected


def micro_batch_token_weights(
    alg: AlgorithmConfig,
    *,
    stare_omega: Tensor | None,
    mask: Tensor,
    old_logprobs: Tensor,
    rollout_logprobs: Tensor,
) -> Tensor | None:
    """The weights [B, T] of one micro-batch's per-token loss: omega times the IS correction (None: all ones)."""
    if alg.mismatch_correction == "none":
        return stare_omega
    # Truncated importance sampling of the engine/trainer mismatch (the engine sampled, the trainer learns).
    correction = mismatch_is_weights(
        old_logprobs,
        rollout_logprobs,
        mask,
        level=alg.mismatch_correction,
        mode=alg.mismatch_mode,
        cap=alg.mismatch_cap,
    )
    return correction if stare_omega is None else stare_omega * correction
