"""On-policy ``Experience`` batches built from token rows, for tests that feed the step functions directly."""

from __future__ import annotations

import torch

from stare_lightning.rollout.base import Rollouts
from stare_lightning.step import Experience
from stare_lightning.step.batch import build_rollout_batch


def on_policy_experience(
    prompts: list[list[int]],
    responses: list[list[int]],
    advantages: torch.Tensor,
    *,
    n: int,
    policy_masks: list[list[bool]] | None = None,
) -> Experience:
    """Rows of the given prompts and responses (every response finished, engine log-probs -1), rewards equal to
    the advantages, no old log-probs: the step scores them itself."""
    rollouts = Rollouts(
        prompt_ids=prompts,
        response_ids=responses,
        response_logprobs=[[-1.0] * len(r) for r in responses],
        texts=[""] * len(responses),
        finish_reasons=["stop"] * len(responses),
        n=n,
        policy_masks=policy_masks,
    )
    batch = build_rollout_batch(rollouts, advantages.clone(), advantages, pad_token_id=0)
    return Experience.build(batch, old_logprobs=None, phi=None, stare_weights=None, stare_selected=None)
