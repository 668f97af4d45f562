"""The counts a step's losses are normalised by: token and sequence counts over the whole optimizer step on every
rank, so the micro-batch losses, summed over micro-batches and ranks, equal the loss of the step's batch; or, with
``algorithm.update.loss_normalizer=micro_batch``, the reference trainer's per-micro-batch token mean."""

from __future__ import annotations

from dataclasses import replace

import torch

from stare_lightning.algorithms import LossNormalizer
from stare_lightning.distributed import all_reduce
from stare_lightning.step.batch import Experience, RolloutBatch

__all__ = ["micro_batch_normalizer", "step_normalizer"]


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


def micro_batch_normalizer(part: Experience, step: LossNormalizer, *, own_token_mean: bool) -> LossNormalizer:
    """``step`` itself, or with ``own_token_mean`` (``loss_normalizer=micro_batch`` and a token mean) the count that
    turns ``aggregate_loss`` into (this micro-batch's token mean) x (its sequences / the step's sequences)."""
    if not own_token_mean:
        return step
    tokens = part.response_mask.sum()
    rows = part.response_mask.any(-1).sum().clamp(min=1)  # a zero-weight filler micro-batch may have none
    return replace(step, num_tokens=tokens.double() * step.num_sequences / rows)
