"""Collection: roll out, verify, shape rewards, compute group advantages, and filter groups (dynamic sampling).

Dynamic sampling (DAPO, Yu et al. 2025) drops groups whose rewards all agree, since their advantages
are zero and they only dilute the token-mean. Departure from DAPO: generation stops after
``max_generation_batches`` batches even if fewer than ``prompts_per_step`` groups survived, and if
none survived the last batch is kept unfiltered (its zero advantages give zero gradient), so every
rank always has rows to run through the collectives of the update.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from stare_lightning.algorithms import AlgorithmConfig, compute_advantages, overlong_penalty, zero_variance_groups
from stare_lightning.rewards.pool import ScoreResult, VerifierPool
from stare_lightning.rollout.base import RolloutEngine, Rollouts, SamplingParams, prompt_seeds
from stare_lightning.step.batch import RolloutBatch, build_rollout_batch


@dataclass(frozen=True)
class ScoredGroups:
    """One generation batch: rollouts with their rewards, grouped ``[num_groups, n]``, and their prompts."""

    items: list[dict]
    rollouts: Rollouts
    correct: Tensor  # [G, n] verifier scores before shaping
    rewards: Tensor  # [G, n] after overlong shaping
    verifier_timeouts: int = 0
    verifier_errors: int = 0


@dataclass
class CollectionStats:
    """Counters over every generation batch of a step, kept or not."""

    generation_batches: int = 0
    verifier_timeouts: int = 0
    verifier_errors: int = 0
    generation_seconds: float = 0.0
    generated_tokens: int = 0
    generated_rewards: list[Tensor] = field(default_factory=list)  # [groups, n] per batch
    zero_std_groups: list[Tensor] = field(default_factory=list)  # bool [groups] per batch

    def add(self, scored: ScoredGroups, zero_std: Tensor) -> None:
        self.generation_batches += 1
        self.verifier_timeouts += scored.verifier_timeouts
        self.verifier_errors += scored.verifier_errors
        self.generation_seconds += scored.rollouts.generation_seconds
        self.generated_tokens += scored.rollouts.num_tokens
        self.generated_rewards.append(scored.rewards)
        self.zero_std_groups.append(zero_std)


@dataclass(frozen=True)
class Collection:
    """What a step trains on (the padded ``batch``) and what it reports about it."""

    batch: RolloutBatch
    items: list[dict]  # the kept prompt records, one per group
    texts: list[str]  # the kept responses, grouped: rows [g * n, (g + 1) * n) answer items[g]
    truncated: Tensor  # bool [rows]: the response hit the token budget (finish reason "length")
    correct: Tensor  # [groups, n] verifier scores of the kept responses
    stats: CollectionStats

    def samples(self) -> list[dict]:
        """Per prompt group: prompt, answer, responses, rewards and advantages (for the rollout dump)."""
        n = self.correct.shape[1]
        rewards, advantages = self.batch.rewards.tolist(), self.batch.advantages.tolist()
        return [
            {
                "id": item.get("id"),
                "prompt": item.get("prompt_text"),
                "answer": item.get("answer"),
                "responses": self.texts[g * n : (g + 1) * n],
                "rewards": rewards[g * n : (g + 1) * n],
                "advantages": advantages[g * n : (g + 1) * n],
            }
            for g, item in enumerate(self.items)
        ]


def verify(items: Sequence[dict], rollouts: Rollouts, pool: VerifierPool) -> ScoreResult:
    """Score every response of ``rollouts`` with its prompt's verifier and answer, in the time-out pool."""
    n = rollouts.n
    calls = [
        (items[row // n]["verifier"], text, items[row // n]["answer"], items[row // n].get("metadata", {}))
        for row, text in enumerate(rollouts.texts)
    ]
    return pool.score(calls)


def score_rollouts(
    items: Sequence[dict], rollouts: Rollouts, pool: VerifierPool, cfg: AlgorithmConfig, max_new_tokens: int
) -> ScoredGroups:
    """Verify every response of ``rollouts`` against its prompt's answer, then apply overlong shaping."""
    n = rollouts.n
    result = verify(items, rollouts, pool)
    correct = torch.tensor(result.scores, dtype=torch.float32).view(-1, n)
    rewards = correct.clone()
    if cfg.overlong_buffer > 0:
        lengths = torch.tensor([len(r) for r in rollouts.response_ids], dtype=torch.float32).view(-1, n)
        rewards = rewards + overlong_penalty(
            lengths, max_new_tokens, cfg.overlong_buffer, penalty_factor=cfg.overlong_penalty_factor
        )
    return ScoredGroups(list(items), rollouts, correct, rewards, result.timeouts, result.errors)


def collect(
    items: list[dict],
    engine: RolloutEngine,
    pool: VerifierPool,
    params: SamplingParams,
    cfg: AlgorithmConfig,
    *,
    pad_token_id: int,
    more_prompts: Callable[[int, int], list[dict]] | None = None,
    all_ranks_agree: Callable[[bool], bool] | None = None,
    seed: int = 0,
) -> Collection:
    """Generate, score and (with dynamic sampling) filter until ``len(items)`` groups carry signal.

    Each prompt's samples are seeded from ``seed``, the generation batch and its record id, never from
    its rank or its position: without dynamic sampling (which filters each rank's groups on their own),
    a run over several ranks collects exactly what a one-rank run on the same global batch collects.
    ``more_prompts(count, attempt)`` supplies the prompts of the next generation batch.
    ``all_ranks_agree(stop)`` is true only when every rank wants to stop: ranks keep generating in
    lockstep (a done rank's extra groups are discarded), since sharded generation is collective.
    """
    target_groups = len(items)
    stats = CollectionStats()
    kept: list[tuple[ScoredGroups, Tensor]] = []  # a generation batch and the ids of its groups kept
    have = 0
    batch_items = items
    while True:
        keys = [f"{stats.generation_batches}/{item['id']}" for item in batch_items]
        rollouts = engine.generate(
            [item["prompt_ids"] for item in batch_items], params, seeds=prompt_seeds(seed, keys, params.n)
        )
        scored = score_rollouts(batch_items, rollouts, pool, cfg, params.max_new_tokens)
        zero_std = zero_variance_groups(scored.rewards)
        stats.add(scored, zero_std)
        keep = ~zero_std if cfg.dynamic_sampling else torch.ones_like(zero_std)
        keep_ids = keep.nonzero().flatten()[: target_groups - have]
        if keep_ids.numel():
            kept.append((scored, keep_ids))
        have += int(keep_ids.numel())
        stop = have >= target_groups or not cfg.dynamic_sampling
        stop = stop or stats.generation_batches >= cfg.max_generation_batches or more_prompts is None
        if all_ranks_agree is not None:
            stop = all_ranks_agree(stop)
        if stop:
            break
        batch_items = more_prompts(target_groups, stats.generation_batches)
    if not kept:  # nothing carried signal: keep the last batch so this rank still takes part in the update
        kept = [(scored, torch.arange(scored.rewards.shape[0]))]
    return _kept_collection(kept, stats, params.n, cfg, pad_token_id)


def _kept_collection(
    kept: list[tuple[ScoredGroups, Tensor]], stats: CollectionStats, n: int, cfg: AlgorithmConfig, pad_token_id: int
) -> Collection:
    """Concatenate the kept groups of every generation batch and compute their advantages."""
    rows = [[int(g) * n + j for g in group_ids.tolist() for j in range(n)] for _, group_ids in kept]
    rollouts = Rollouts(
        **{
            name: [getattr(scored.rollouts, name)[i] for (scored, _), keep in zip(kept, rows) for i in keep]
            for name in ("prompt_ids", "response_ids", "response_logprobs", "texts", "finish_reasons")
        },
        n=n,
    )
    rewards = torch.cat([scored.rewards[g] for scored, g in kept])
    correct = torch.cat([scored.correct[g] for scored, g in kept])
    advantages = compute_advantages(rewards, estimator=cfg.advantage, eps=cfg.adv_eps)
    batch = build_rollout_batch(rollouts, rewards.flatten(), advantages.flatten(), pad_token_id=pad_token_id)
    items = [scored.items[i] for scored, g in kept for i in g.tolist()]
    truncated = torch.tensor([reason == "length" for reason in rollouts.finish_reasons], dtype=torch.bool)
    return Collection(batch=batch, items=items, texts=rollouts.texts, truncated=truncated, correct=correct, stats=stats)
