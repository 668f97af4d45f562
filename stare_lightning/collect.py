"""One step's experience: roll out, score, shape rewards, compute group advantages, filter groups.

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

from stare_lightning.algorithms import (
    AlgorithmConfig,
    compute_advantages,
    overlong_penalty,
    zero_variance_groups,
)
from stare_lightning.experience import Experience, build_experience
from stare_lightning.rewards.pool import VerifierPool
from stare_lightning.rollout.base import RolloutEngine, Rollouts, SamplingParams, prompt_seeds


@dataclass
class ScoredGroups:
    """Rollouts with their rewards, grouped ``[num_groups, n]``, and the prompt items they answer."""

    items: list[dict]
    rollouts: Rollouts
    correct: torch.Tensor  # [G, n] verifier scores before shaping
    rewards: torch.Tensor  # [G, n] after overlong shaping
    verifier_timeouts: int = 0
    verifier_errors: int = 0


@dataclass
class CollectionStats:
    generation_batches: int = 0
    groups_generated: int = 0
    zero_std_groups: int = 0
    verifier_timeouts: int = 0
    verifier_errors: int = 0
    generation_seconds: float = 0.0
    generated_tokens: int = 0
    kept_items: list[dict] = field(default_factory=list)
    kept_texts: list[str] = field(default_factory=list)
    kept_correct: torch.Tensor | None = None
    generated_rewards: list[torch.Tensor] = field(default_factory=list)  # [groups, n] of every batch, kept or not


def score_rollouts(
    items: Sequence[dict], rollouts: Rollouts, pool: VerifierPool, cfg: AlgorithmConfig, max_new_tokens: int
) -> ScoredGroups:
    n = rollouts.n
    calls = [
        (items[row // n]["verifier"], text, items[row // n]["answer"], items[row // n].get("metadata", {}))
        for row, text in enumerate(rollouts.texts)
    ]
    result = pool.score(calls)
    correct = torch.tensor(result.scores, dtype=torch.float32).view(-1, n)
    rewards = correct.clone()
    if cfg.overlong_buffer > 0:
        lengths = torch.tensor([len(r) for r in rollouts.response_ids], dtype=torch.float32).view(-1, n)
        rewards = rewards + overlong_penalty(
            lengths, max_new_tokens, cfg.overlong_buffer, penalty_factor=cfg.overlong_penalty_factor
        )
    return ScoredGroups(list(items), rollouts, correct, rewards, result.timeouts, result.errors)


def _concat_rollouts(parts: list[Rollouts], rows: list[torch.Tensor]) -> Rollouts:
    def gather(name: str) -> list:
        return [getattr(part, name)[i] for part, keep in zip(parts, rows) for i in keep.tolist()]

    names = ("prompt_ids", "response_ids", "response_logprobs", "texts", "finish_reasons")
    return Rollouts(**{name: gather(name) for name in names}, n=parts[0].n)


def collect_experience(
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
) -> tuple[Experience, CollectionStats]:
    """Generate, score and (with dynamic sampling) filter until ``len(items)`` groups carry signal.

    Each prompt's samples are seeded from ``seed``, the generation batch and its record id, never from
    its rank or its position: without dynamic sampling (which filters each rank's groups on their own),
    a run over several ranks collects exactly the experience of a one-rank run on the same global batch.
    ``all_ranks_agree(stop)`` is true only when every rank wants to stop: ranks keep generating in
    lockstep (a done rank's extra groups are discarded), since sharded generation is collective.
    """
    target_groups = len(items)
    stats = CollectionStats()
    kept: list[ScoredGroups] = []
    kept_group_ids: list[torch.Tensor] = []
    batch_items = items
    last: ScoredGroups | None = None
    while True:
        keys = [f"{stats.generation_batches}/{item['id']}" for item in batch_items]
        rollouts = engine.generate(
            [item["prompt_ids"] for item in batch_items], params, seeds=prompt_seeds(seed, keys, params.n)
        )
        scored = score_rollouts(batch_items, rollouts, pool, cfg, params.max_new_tokens)
        last = scored
        stats.generation_batches += 1
        stats.groups_generated += len(batch_items)
        stats.verifier_timeouts += scored.verifier_timeouts
        stats.verifier_errors += scored.verifier_errors
        stats.generation_seconds += rollouts.generation_seconds
        stats.generated_tokens += rollouts.num_tokens
        stats.generated_rewards.append(scored.rewards)
        zero_std = zero_variance_groups(scored.rewards)
        stats.zero_std_groups += int(zero_std.sum())
        keep = ~zero_std if cfg.dynamic_sampling else torch.ones_like(zero_std)
        have = sum(int(g.numel()) for g in kept_group_ids)
        keep_ids = keep.nonzero().flatten()[: target_groups - have]
        if keep_ids.numel():
            kept.append(scored)
            kept_group_ids.append(keep_ids)
        have += int(keep_ids.numel())
        done = have >= target_groups or not cfg.dynamic_sampling
        stop = done or stats.generation_batches >= cfg.max_generation_batches or more_prompts is None
        if all_ranks_agree is not None:
            stop = all_ranks_agree(stop)
        if stop:
            break
        batch_items = more_prompts(target_groups, stats.generation_batches)
    if not kept:  # nothing carried signal: keep the last batch so this rank still takes part in the update
        kept, kept_group_ids = [last], [torch.arange(last.rewards.shape[0])]
    n = params.n
    row_ids = [(g.unsqueeze(1) * n + torch.arange(n)).flatten() for g in kept_group_ids]
    rollouts = _concat_rollouts([s.rollouts for s in kept], row_ids)
    rewards = torch.cat([s.rewards[g] for s, g in zip(kept, kept_group_ids)])
    correct = torch.cat([s.correct[g] for s, g in zip(kept, kept_group_ids)])
    advantages = compute_advantages(rewards, estimator=cfg.advantage, eps=cfg.adv_eps)
    experience = build_experience(rollouts, rewards.flatten(), advantages.flatten(), pad_token_id=pad_token_id)
    stats.kept_items = [s.items[i] for s, g in zip(kept, kept_group_ids) for i in g.tolist()]
    stats.kept_texts = rollouts.texts
    stats.kept_correct = correct
    return experience, stats
