"""The loss of one micro-batch: a forward of the policy, its token weights, and the policy loss.

Losses are normalised by counts over the whole optimizer step on every rank (``normalizer.step_normalizer``), so
the micro-batch losses, summed over micro-batches and ranks, equal the loss of the step's batch. With
``algorithm.update.loss_normalizer=micro_batch`` a token-mean loss is each micro-batch's own token mean weighted by its
share of the step's sequences, as the reference trainer (verl 0.7's data-parallel actor) computes it: short and
long micro-batches then weigh their tokens differently.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from stare_lightning.algorithms import LossNormalizer, TokenStats, policy_loss
from stare_lightning.algorithms.stare_controller import StepParams
from stare_lightning.algorithms.token_weights import micro_batch_token_weights
from stare_lightning.step.batch import Experience
from stare_lightning.step.forward import PADDED, ForwardLayout, response_token_stats
from stare_lightning.step.normalizer import micro_batch_normalizer
from stare_lightning.step.selection import TokenSelection

if TYPE_CHECKING:
    from stare_lightning.models.reference import ReferencePolicy
    from stare_lightning.step.plan import LossPlan


@dataclass(frozen=True)
class MicroBatchLoss:
    """One micro-batch's loss and what the telemetry needs of it."""

    loss: Tensor
    sums: dict[str, Tensor]  # detached sums of ``policy_loss`` (clip counts, KL, tokens)
    token_stats: TokenStats  # the policy's statistics from this forward
    stare_omega: Tensor | None  # STARE's weights applied here (None: all ones)
    stare_selected: Tensor | None  # the tokens STARE selected here (None: no selection, STARE off)


def micro_batch_loss(
    policy: torch.nn.Module,
    reference: ReferencePolicy | None,
    part: Experience,
    normalizer: LossNormalizer,
    plan: LossPlan,
    *,
    params: StepParams,
    entropy_coef: float,
    temperature: float,
    chunk_size: int,
    layout: ForwardLayout = PADDED,
    selection: TokenSelection,
    seed: int = 0,
) -> MicroBatchLoss:
    """The loss of one micro-batch, with its sums, token statistics and STARE's weights. Without old log-probs
    (on-policy, no scoring pass) this forward's detached log-probs are the old ones (ratio exactly 1), and its
    statistics, entropy terms included, describe the rollout policy. ``plan.old_logprobs_from_forward`` uses
    them even when a scoring pass gave old log-probs (the reference code). ``selection``: the step's STARE
    selection; ``seed``: this micro-batch's, for a selection made here."""
    on_policy_first_pass = part.old_logprobs is None
    # Before the policy's forward: a LoRA reference is the policy itself (adapters off), and a second forward of
    # the same module between the first and its backward would interleave with FSDP2's gathers.
    ref_logprobs = _reference_logprobs(reference, part, layout, temperature=temperature, chunk_size=chunk_size)
    stats = _policy_token_stats(policy, part, layout, plan, selection, temperature=temperature, chunk_size=chunk_size)
    from_forward = on_policy_first_pass or plan.old_logprobs_from_forward
    old_logprobs = stats.logprobs.detach() if from_forward else part.old_logprobs
    stare_omega, stare_selected = selection.in_micro_batch(part, stats, old_logprobs, params, seed=seed)
    weights = micro_batch_token_weights(
        plan.mismatch,
        stare_omega=stare_omega,
        mask=part.response_mask,
        old_logprobs=old_logprobs,
        rollout_logprobs=part.rollout_logprobs,
        advantages=part.advantages,
        signs=params.signs,
    )
    loss, loss_stats = policy_loss(
        stats.logprobs,
        old_logprobs,
        part.advantages,
        part.response_mask,
        plan.objective,
        micro_batch_normalizer(part, normalizer, own_token_mean=plan.micro_batch_token_mean),
        token_weights=weights,
        ref_logprobs=ref_logprobs,
        entropy=stats.entropy if plan.needs_entropy else None,
        entropy_coef=entropy_coef,
    )
    return MicroBatchLoss(loss, loss_stats, stats, stare_omega, stare_selected)


def _policy_token_stats(
    policy: torch.nn.Module,
    part: Experience,
    layout: ForwardLayout,
    plan: LossPlan,
    selection: TokenSelection,
    *,
    temperature: float,
    chunk_size: int,
) -> TokenStats:
    """The policy's forward over ``part``, with the statistics the loss needs, those an on-policy first pass keeps
    as the rollout policy's, and the Phi or entropy a selection made here from the current policy reads."""
    on_policy_first_pass = part.old_logprobs is None
    current_phi, current_entropy = selection.loss_forward_needs()
    return response_token_stats(
        policy,
        part,
        layout,
        temperature=temperature,
        chunk_size=chunk_size,
        with_entropy=plan.needs_entropy or on_policy_first_pass or current_phi or current_entropy,
        with_sensitivity=on_policy_first_pass or current_phi,
    )


@torch.no_grad()
def _reference_logprobs(
    reference: ReferencePolicy | None, part: Experience, layout: ForwardLayout, *, temperature: float, chunk_size: int
) -> Tensor | None:
    if reference is None:
        return None
    with reference.scoring() as model:
        return response_token_stats(
            model, part, layout, temperature=temperature, chunk_size=chunk_size, with_entropy=False
        ).logprobs
