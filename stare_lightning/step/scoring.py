"""The policy's per-token statistics on response tokens: one forward per micro-batch, and the step's no-grad pass.

``TokenScores`` holds, for every response token of the step, the log-prob of the sampled token, the
full-vocabulary entropy and the two reductions that give its entropy sensitivity Phi (docs/method.md,
section 2), all at the sampling temperature. They come either from a no-grad pass of the rollout policy
before any update (``score_batch``) or, for plain on-policy GRPO, from the first forward of the update.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from torch.nn.functional import pad

from stare_lightning.algorithms import TokenStats, entropy_sensitivity, token_stats_from_logits
from stare_lightning.step.batch import RolloutBatch, micro_batches


@dataclass(frozen=True)
class TokenScores:
    """Per-token statistics of the rollout policy, ``[rows, response_width]`` each, detached float32."""

    logprobs: Tensor
    entropy: Tensor
    sum_p2: Tensor
    sum_p2_logp: Tensor
    phi: Tensor  # entropy sensitivity of the sampled token

    @classmethod
    def from_micro_batches(cls, parts: list[TokenStats], width: int) -> TokenScores:
        """Join the statistics of consecutive micro-batches (each trimmed to its own width) at ``width``."""

        def joined(name: str) -> Tensor:
            values = [getattr(stats, name).detach().float() for stats in parts]
            return torch.cat([pad(v, (0, width - v.shape[1])) for v in values])

        logprobs, entropy, sum_p2, sum_p2_logp = (joined(n) for n in ("logprobs", "entropy", "sum_p2", "sum_p2_logp"))
        phi = entropy_sensitivity(logprobs, entropy, sum_p2, sum_p2_logp)
        return cls(logprobs=logprobs, entropy=entropy, sum_p2=sum_p2, sum_p2_logp=sum_p2_logp, phi=phi)


def response_token_stats(
    model: torch.nn.Module,
    batch: RolloutBatch,
    *,
    temperature: float,
    chunk_size: int,
    with_entropy: bool = True,
    with_sensitivity: bool = False,
) -> TokenStats:
    """Log-probs of the sampled response tokens (and entropy terms) under ``model``, temperature-scaled.

    Only the logits that score response tokens are kept (``logits_to_keep``), which saves the
    ``[rows, prompt_width, vocab]`` block a plain forward would return.
    """
    output = model(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        position_ids=batch.position_ids(),
        use_cache=False,
        logits_to_keep=batch.response_width + 1,
    )
    logits = output.logits[:, :-1]  # the logit at column c scores the token at column c + 1
    return token_stats_from_logits(
        logits,
        batch.response_ids,
        temperature=temperature,
        chunk_size=chunk_size,
        with_entropy=with_entropy,
        with_sensitivity=with_sensitivity,
    )


@torch.no_grad()
def score_batch(
    policy: torch.nn.Module, batch: RolloutBatch, *, temperature: float, chunk_size: int, micro_batch_tokens: int
) -> TokenScores:
    """The rollout policy's ``TokenScores`` over the whole batch, micro-batch by micro-batch, in eval mode."""
    policy.eval()
    parts = [
        response_token_stats(policy, part, temperature=temperature, chunk_size=chunk_size, with_sensitivity=True)
        for part in micro_batches(batch, micro_batch_tokens)
    ]
    policy.train()
    return TokenScores.from_micro_batches(parts, batch.response_width)
