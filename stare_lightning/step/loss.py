"""The loss of one micro-batch: a forward of the policy, its token weights, and the policy loss.

Losses are normalised by counts over the whole optimizer step on every rank (``step_normalizer``), so
the micro-batch losses, summed over micro-batches and ranks, equal the loss of the step's batch.
"""

from __future__ import annotations

import torch
from torch import Tensor

from stare_lightning.algorithms import AlgorithmConfig, LossNormalizer, TokenStats, policy_loss
from stare_lightning.algorithms.stare_controller import StepParams
from stare_lightning.algorithms.token_weights import micro_batch_token_weights
from stare_lightning.distributed import all_reduce
from stare_lightning.step.batch import Experience
from stare_lightning.step.scoring import response_token_stats


def step_normalizer(mini: Experience, *, max_response_length: int, device: torch.device) -> LossNormalizer:
    """Token and sequence counts of a mini-batch over all ranks (each at least 1)."""
    counts = torch.tensor([float(mini.response_mask.sum()), float(mini.response_mask.any(-1).sum())])
    counts = all_reduce(counts.to(device), device=device)
    return LossNormalizer(
        num_tokens=max(int(counts[0]), 1),
        num_sequences=max(int(counts[1]), 1),
        max_response_length=max_response_length,
    )


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
) -> tuple[Tensor, dict[str, Tensor], TokenStats]:
    """(loss, its detached sums, the policy's token statistics) of one micro-batch.

    Without old log-probs (on-policy, no scoring pass) the forward also returns the entropy terms, and
    its detached log-probs are the old ones: the ratio is exactly 1 and the statistics describe the
    rollout policy.
    """
    on_policy_first_pass = part.old_logprobs is None
    stats = response_token_stats(
        policy,
        part,
        temperature=temperature,
        chunk_size=chunk_size,
        with_entropy=alg.needs_entropy() or on_policy_first_pass,
        with_sensitivity=on_policy_first_pass,
    )
    old_logprobs = stats.logprobs.detach() if on_policy_first_pass else part.old_logprobs
    weights = micro_batch_token_weights(
        alg,
        advantages=part.advantages,
        mask=part.response_mask,
        current_logprobs=stats.logprobs.detach(),
        old_logprobs=old_logprobs,
        rollout_logprobs=part.rollout_logprobs,
        step_omega=part.stare_weights,
        params=params,
        phi=part.phi,
    )
    ref_logprobs = None
    if reference is not None:
        with torch.no_grad():
            ref_logprobs = response_token_stats(
                reference, part, temperature=temperature, chunk_size=chunk_size, with_entropy=False
            ).logprobs
    loss, loss_stats = policy_loss(
        stats.logprobs,
        old_logprobs,
        part.advantages,
        part.response_mask,
        alg,
        normalizer,
        token_weights=weights,
        ref_logprobs=ref_logprobs,
        entropy=stats.entropy if alg.needs_entropy() else None,
        entropy_coef=entropy_coef,
    )
    return loss, loss_stats, stats
