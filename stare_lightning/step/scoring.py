"""The policy's per-token statistics on response tokens: one forward per micro-batch, and the step's no-grad pass.

``TokenScores`` holds, for every response token of the step, the log-prob of the sampled token, the
full-vocabulary entropy and the two reductions that give its entropy sensitivity Phi (docs/method.md,
section 2), all at the sampling temperature. They come either from a no-grad pass of the rollout policy
before any update (``score_batch``) or, for plain on-policy GRPO, from the first forward of the update.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn.functional import pad

from stare_lightning import distributed
from stare_lightning.algorithms import TokenStats, entropy_sensitivity, token_stats_from_logits
from stare_lightning.algorithms.entropy_change import entropy_change
from stare_lightning.step.batch import RolloutBatch, Rows, filler_micro_batch, micro_batches
from stare_lightning.step.forward import PADDED, ForwardLayout, micro_batch_logits, response_token_stats


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


def forwards_in_step(batch: Rows, micro_batch_tokens: int, *, packed: bool) -> tuple[list[Rows], int]:
    """``batch``'s micro-batches, then fillers (its first row) up to the most any rank has, and how many are real.

    A sharded policy's forward is a collective (FSDP gathers each layer's parameters), so every rank must run as
    many forwards as the others, even in a no-grad pass; a filler's output is dropped.
    """
    parts = list(micro_batches(batch, micro_batch_tokens, packed=packed))
    count = torch.tensor(float(len(parts)), device=batch.input_ids.device)
    most = int(distributed.all_reduce(count, dist.ReduceOp.MAX))
    return parts + [filler_micro_batch(batch)] * (most - len(parts)), len(parts)


@torch.no_grad()
def response_logits(
    policy: torch.nn.Module, batch: RolloutBatch, *, micro_batch_tokens: int, layout: ForwardLayout = PADDED
) -> list[Tensor]:
    """The policy's response logits, one tensor per micro-batch of ``micro_batches(batch, ...)``, in eval mode
    (with the fillers of ``forwards_in_step`` run and dropped)."""
    policy.eval()
    parts, real = forwards_in_step(batch, micro_batch_tokens, packed=layout.packed)
    logits = [micro_batch_logits(policy, part, layout) for part in parts]
    policy.train()
    return logits[:real]


@torch.no_grad()
def same_batch_entropy_change(
    policy: torch.nn.Module,
    batch: RolloutBatch,
    logits_before: list[Tensor],
    *,
    temperature: float,
    chunk_size: int,
    micro_batch_tokens: int,
    layout: ForwardLayout = PADDED,
) -> tuple[Tensor, Tensor]:
    """(realised, first-order) change ``[rows, response_width]`` of the policy's entropy on ``batch`` since
    ``logits_before`` (``response_logits`` with the same ``micro_batch_tokens``); see ``entropy_change``."""
    logits_after = response_logits(policy, batch, micro_batch_tokens=micro_batch_tokens, layout=layout)
    parts = [
        entropy_change(before, after, temperature=temperature, chunk_size=chunk_size)
        for before, after in zip(logits_before, logits_after, strict=True)
    ]
    width = batch.response_width
    realised = torch.cat([pad(r, (0, width - r.shape[1])) for r, _ in parts])
    first_order = torch.cat([pad(f, (0, width - f.shape[1])) for _, f in parts])
    return realised, first_order


# The same keyword options as score_batch on purpose: the two differ only in where the logits come from.
@torch.no_grad()
def scores_from_logits(
    logits: list[Tensor],
    batch: RolloutBatch,
    *,
    temperature: float,
    chunk_size: int,
    micro_batch_tokens: int,
    layout: ForwardLayout = PADDED,
) -> TokenScores:
    """``score_batch`` from logits already computed (``response_logits`` with the same ``micro_batch_tokens``):
    the same numbers without a second forward when the same-batch entropy telemetry holds them anyway."""
    rows = micro_batches(batch, micro_batch_tokens, packed=layout.packed)
    parts = [
        token_stats_from_logits(
            part_logits, part.response_ids, temperature=temperature, chunk_size=chunk_size, with_sensitivity=True
        )
        for part_logits, part in zip(logits, rows, strict=True)
    ]
    return TokenScores.from_micro_batches(parts, batch.response_width)


@torch.no_grad()
def score_batch(
    policy: torch.nn.Module,
    batch: RolloutBatch,
    *,
    temperature: float,
    chunk_size: int,
    micro_batch_tokens: int,
    layout: ForwardLayout = PADDED,
) -> TokenScores:
    """The rollout policy's ``TokenScores`` over the whole batch, micro-batch by micro-batch, in eval mode."""
    policy.eval()
    parts, real = forwards_in_step(batch, micro_batch_tokens, packed=layout.packed)
    options = {"temperature": temperature, "chunk_size": chunk_size, "with_sensitivity": True}
    stats = [response_token_stats(policy, part, layout, **options) for part in parts]
    policy.train()
    return TokenScores.from_micro_batches(stats[:real], batch.response_width)
