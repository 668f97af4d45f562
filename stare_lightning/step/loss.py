"""The loss of one micro-batch: a forward of the policy, its token weights, and the policy loss.

Losses are normalised by counts over the whole optimizer step on every rank (``step_normalizer``), so
the micro-batch losses, summed over micro-batches and ranks, equal the loss of the step's batch. With
``algorithm.loss_normalizer=micro_batch`` a token-mean loss is each micro-batch's own token mean weighted by its
share of the step's sequences, as the reference trainer (verl 0.7's data-parallel actor) computes it: short and
long micro-batches then weigh their tokens differently.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor

from stare_lightning.algorithms import (
    AlgorithmConfig,
    LossNormalizer,
    TokenStats,
    aggregate_loss,
    entropy_sensitivity,
    micro_batch_stare_weights,
    micro_batch_token_weights,
    policy_loss,
    selection_timing,
)
from stare_lightning.algorithms.stare_controller import StepParams
from stare_lightning.algorithms.token_weights import SelectionTiming
from stare_lightning.distributed import all_reduce
from stare_lightning.step.batch import Experience, RolloutBatch
from stare_lightning.step.forward import PADDED, ForwardLayout, response_token_stats


def step_normalizer(
    mini: Experience | RolloutBatch, *, max_response_length: int, device: torch.device
) -> LossNormalizer:
    """Token and sequence counts of a mini-batch over all ranks (each at least 1)."""
    counts = torch.tensor([float(mini.response_mask.sum()), float(mini.response_mask.any(-1).sum())])
    counts = all_reduce(counts.to(device), device=device)
    return LossNormalizer(
        num_tokens=max(int(counts[0]), 1),
        num_sequences=max(int(counts[1]), 1),
        max_response_length=max_response_length,
    )


def micro_batch_normalizer(part: Experience, step: LossNormalizer, alg: AlgorithmConfig) -> LossNormalizer:
    """``step`` itself, or with ``loss_normalizer=micro_batch`` and a token mean the count that turns
    ``aggregate_loss`` into (this micro-batch's token mean) x (its sequences / the step's sequences)."""
    if alg.loss_normalizer != "micro_batch" or alg.loss_agg != "token-mean":
        return step
    tokens = part.response_mask.sum()
    rows = part.response_mask.any(-1).sum().clamp(min=1)  # a zero-weight filler micro-batch may have none
    return replace(step, num_tokens=tokens.double() * step.num_sequences / rows)


def token_mean(values: Tensor, mask: Tensor, *, device: torch.device) -> float:
    """The mean of ``values`` over every rank's valid tokens (float64 sums; NaN when there is none)."""
    valid = mask.to(torch.bool)
    total = torch.where(valid, values.detach().double(), torch.zeros((), dtype=torch.float64, device=values.device))
    sums = torch.stack([total.sum(), valid.sum().double()])
    total_sum, count = all_reduce(sums.to(device), device=device).tolist()
    return total_sum / count if count else float("nan")


def gate_entropy(entropy: Tensor, batch: RolloutBatch, alg: AlgorithmConfig, *, max_response_length: int) -> float:
    """The entropy that drives STARE's gate, over every rank's rows, aggregated as ``alg.gate_loss_agg()``
    says: the token mean, or like the loss (``aggregate_loss`` under the step's global counts)."""
    normalizer = step_normalizer(batch, max_response_length=max_response_length, device=entropy.device)
    mask = batch.response_mask
    share = aggregate_loss(entropy.detach().double(), mask, alg.gate_loss_agg(), normalizer)
    return float(all_reduce(share, device=entropy.device))


# Timing, selector and surprisal source of a selection made inside the loss from this forward's Phi.
SELECTS_BY_PHI = (SelectionTiming.MICRO_BATCH, "sensitivity", "current")


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
    reference: torch.nn.Module | None,
    part: Experience,
    normalizer: LossNormalizer,
    alg: AlgorithmConfig,
    *,
    params: StepParams,
    entropy_coef: float,
    temperature: float,
    chunk_size: int,
    layout: ForwardLayout = PADDED,
) -> MicroBatchLoss:
    """The loss of one micro-batch, with its sums, token statistics and STARE's weights. Without old log-probs
    (on-policy, no scoring pass) this forward's detached log-probs are the old ones (ratio exactly 1), and its
    statistics, entropy terms included, describe the rollout policy. ``on_policy_old_logprobs=forward`` uses
    them even when a scoring pass gave old log-probs (the reference code)."""
    on_policy_first_pass = part.old_logprobs is None
    # A selection made here by the current policy's sensitivity needs this forward's Phi.
    current_phi = (selection_timing(stare := alg.stare), stare.selector, stare.surprisal_source) == SELECTS_BY_PHI
    stats = response_token_stats(
        policy, part, layout, temperature=temperature, chunk_size=chunk_size,
        with_entropy=alg.needs_entropy() or on_policy_first_pass or current_phi,
        with_sensitivity=on_policy_first_pass or current_phi,
    )  # fmt: skip
    from_forward = on_policy_first_pass or alg.on_policy_old_logprobs == "forward"  # only on-policy (checked)
    old_logprobs = stats.logprobs.detach() if from_forward else part.old_logprobs
    stare_omega, stare_selected = micro_batch_stare_weights(
        alg,
        advantages=part.advantages,
        mask=part.response_mask,
        current_logprobs=stats.logprobs.detach(),
        old_logprobs=old_logprobs,
        step_omega=part.stare_weights,
        step_selected=part.stare_selected,
        params=params,
        phi=_sensitivity(stats) if current_phi else part.phi,
    )
    weights = micro_batch_token_weights(
        alg,
        stare_omega=stare_omega,
        mask=part.response_mask,
        old_logprobs=old_logprobs,
        rollout_logprobs=part.rollout_logprobs,
    )
    ref_logprobs = _reference_logprobs(reference, part, layout, temperature=temperature, chunk_size=chunk_size)
    loss, loss_stats = policy_loss(
        stats.logprobs,
        old_logprobs,
        part.advantages,
        part.response_mask,
        alg,
        micro_batch_normalizer(part, normalizer, alg),
        token_weights=weights,
        ref_logprobs=ref_logprobs,
        entropy=stats.entropy if alg.needs_entropy() else None,
        entropy_coef=entropy_coef,
    )
    return MicroBatchLoss(loss, loss_stats, stats, stare_omega, stare_selected)


@torch.no_grad()
def _reference_logprobs(
    reference, part: Experience, layout: ForwardLayout, *, temperature: float, chunk_size: int
) -> Tensor | None:
    if reference is None:
        return None
    return response_token_stats(
        reference, part, layout, temperature=temperature, chunk_size=chunk_size, with_entropy=False
    ).logprobs


def _sensitivity(stats: TokenStats) -> Tensor:
    return entropy_sensitivity(
        stats.logprobs.detach(), stats.entropy.detach(), stats.sum_p2.detach(), stats.sum_p2_logp.detach()
    )
