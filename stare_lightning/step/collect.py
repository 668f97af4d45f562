"""Collection: roll out, verify, shape rewards, compute group advantages, and filter groups (dynamic sampling).
Its settings are ``algorithm.collection`` and ``algorithm.advantage``.

Dynamic sampling (DAPO, Yu et al. 2025) drops groups whose rewards all agree, since their advantages
are zero and they only dilute the token-mean. It filters the global batch, as verl does: each rank generates
its share of every generation batch, the ranks exchange which groups survived, the first surviving groups of
the global batch (in global prompt order) are kept until the step has its global number of groups, and the
kept groups are then dealt back to the ranks in near-equal contiguous shares. The step's batch is therefore
the same for any number of ranks. A generation batch holds ``generation_batch_multiplier`` times the step's
prompts (the first one the step's own prompts, then fresh draws). Groups are filtered on the shaped reward
(what the advantages see), or with ``dynamic_sampling_metric=score`` on the verifier's raw score, as the reference
code filters on accuracy. When ``max_generation_batches`` batches leave the step short, the project trains on the
groups kept (if none survived each rank keeps its last batch unfiltered: its zero advantages give zero
gradient, and every rank still has rows for the collectives of the update); ``budget_exhausted=stop`` stops the
run with an error, as the reference code does. With fewer kept groups than ranks, a rank dealt none holds a
stand-in: its last batch's rows with no token to train on (an all-false response mask) and no group to report, so
the step's loss, its token-mean and its metrics are those of the kept groups alone, as on one rank.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace

import torch
from torch import Tensor

from stare_lightning import distributed
from stare_lightning.algorithms import compute_advantages, overlong_penalty, zero_variance_groups
from stare_lightning.algorithms.config_groups import AdvantageConfig, CollectionConfig
from stare_lightning.rewards.pool import ScoreResult, VerifierPool
from stare_lightning.rollout.base import EpisodeStats, RolloutEngine, Rollouts, SamplingParams, prompt_seeds
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
    verify_seconds: float = 0.0


@dataclass
class CollectionStats:
    """Counters over every generation batch of a step, kept or not."""

    generation_batches: int = 0
    verifier_timeouts: int = 0
    verifier_errors: int = 0
    generation_seconds: float = 0.0
    tool_seconds: float = 0.0
    verify_seconds: float = 0.0
    generated_tokens: int = 0
    generated_rewards: list[Tensor] = field(default_factory=list)  # [groups, n] per batch
    zero_std_groups: list[Tensor] = field(default_factory=list)  # bool [groups] per batch

    def off_the_step(self) -> CollectionStats:
        """These counters with no seconds: the collection ran beside the step (step/producer.py), not inside it."""
        return replace(self, generation_seconds=0.0, tool_seconds=0.0, verify_seconds=0.0)

    def add(self, scored: ScoredGroups, zero_std: Tensor) -> None:
        self.generation_batches += 1
        self.verifier_timeouts += scored.verifier_timeouts
        self.verifier_errors += scored.verifier_errors
        self.generation_seconds += scored.rollouts.generation_seconds
        self.tool_seconds += scored.rollouts.tool_seconds
        self.verify_seconds += scored.verify_seconds
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
    episodes: list[EpisodeStats]  # how each kept response came about (tool calls, turns)

    def samples(self) -> list[dict]:
        """Per prompt group: prompt, answer, responses, rewards and advantages (for the rollout dump); with a
        tool, each response's episode too: its turns, marked "policy" or "tool", and its counters."""
        n = self.correct.shape[1]
        rewards, advantages = self.batch.rewards.tolist(), self.batch.advantages.tolist()
        groups = []
        for g, item in enumerate(self.items):
            group = {
                "id": item.get("id"),
                "prompt": item.get("prompt_text"),
                "answer": item.get("answer"),
                "responses": self.texts[g * n : (g + 1) * n],
                "rewards": rewards[g * n : (g + 1) * n],
                "advantages": advantages[g * n : (g + 1) * n],
            }
            episodes = self.episodes[g * n : (g + 1) * n]
            if any(e.segments for e in episodes):
                group["episodes"] = [asdict(e) for e in episodes]
            groups.append(group)
        return groups


def verify(items: Sequence[dict], rollouts: Rollouts, pool: VerifierPool) -> ScoreResult:
    """Score every response of ``rollouts`` with its prompt's verifier and answer, in the time-out pool."""
    n = rollouts.n
    calls = [
        (items[row // n]["verifier"], text, items[row // n]["answer"], items[row // n].get("metadata", {}))
        for row, text in enumerate(rollouts.texts)
    ]
    return pool.score(calls)


def score_rollouts(
    items: Sequence[dict], rollouts: Rollouts, pool: VerifierPool, cfg: CollectionConfig, max_new_tokens: int
) -> ScoredGroups:
    """Verify every response of ``rollouts`` against its prompt's answer, then apply overlong shaping."""
    n = rollouts.n
    started = time.perf_counter()
    result = verify(items, rollouts, pool)
    seconds = time.perf_counter() - started
    correct = torch.tensor(result.scores, dtype=torch.float32).view(-1, n)
    rewards = correct.clone()
    if cfg.overlong_buffer > 0:
        lengths = torch.tensor([len(r) for r in rollouts.response_ids], dtype=torch.float32).view(-1, n)
        rewards = rewards + overlong_penalty(
            lengths, max_new_tokens, cfg.overlong_buffer, penalty_factor=cfg.overlong_penalty_factor
        )
    return ScoredGroups(list(items), rollouts, correct, rewards, result.timeouts, result.errors, seconds)


def collect(
    items: list[dict],
    engine: RolloutEngine,
    pool: VerifierPool,
    params: SamplingParams,
    cfg: CollectionConfig,
    advantage: AdvantageConfig,
    *,
    pad_token_id: int,
    more_prompts: Callable[[int, int], list[dict]] | None = None,
    seed: int = 0,
) -> Collection:
    """Generate, score and (with dynamic sampling) filter until the global batch has its groups with signal.

    Each prompt's samples are seeded from ``seed``, the generation batch and its record id, never from its
    rank or its position, so a run over several ranks collects exactly what a one-rank run on the same
    global batch collects, with or without dynamic sampling. ``more_prompts(count, attempt)`` supplies this
    rank's prompts of the next generation batch. Every rank must call this at once (the decisions are global).
    """
    rank = distributed.rank()
    target = sum(distributed.all_gather_objects(len(items)))
    stats = CollectionStats()
    kept: list[tuple[int, ScoredGroups, list[int]]] = []  # generation batch number, its groups, those kept here
    have = 0
    per_round = len(items) * cfg.generation_batch_multiplier
    extra = more_prompts(per_round - len(items), 0) if per_round > len(items) and more_prompts else []
    batch_items = items + extra
    while True:
        keys = _seed_keys(batch_items, stats.generation_batches, own=len(items))
        rollouts = engine.generate(
            [item["prompt_ids"] for item in batch_items], params, seeds=prompt_seeds(seed, keys, params.n)
        )
        scored = score_rollouts(batch_items, rollouts, pool, cfg, params.max_new_tokens)
        zero_std = zero_variance_groups(scored.correct if cfg.dynamic_sampling_metric == "score" else scored.rewards)
        stats.add(scored, zero_std)
        survives = (~zero_std if cfg.dynamic_sampling else torch.ones_like(zero_std)).tolist()
        chosen, mine = _chosen_groups(survives, target - have, rank)
        if mine:
            kept.append((stats.generation_batches, scored, mine))
        have += chosen
        stop = have >= target or not cfg.dynamic_sampling
        if stop or stats.generation_batches >= cfg.max_generation_batches or more_prompts is None:
            break
        batch_items = more_prompts(per_round, stats.generation_batches)
    if cfg.dynamic_sampling and cfg.budget_exhausted == "stop" and have < target:
        _budget_exhausted(cfg, have, target, stats.generation_batches)
    if have == 0:  # nothing carried signal: keep the last batch so this rank still takes part in the update
        return _kept_collection([(scored, None)], stats, params.n, advantage, pad_token_id)
    if not (cfg.dynamic_sampling and distributed.is_distributed()):
        return _kept_collection(
            [(scored, groups) for _, scored, groups in kept], stats, params.n, advantage, pad_token_id
        )
    share = _dealt_share(kept, rank)
    if not share.items:  # fewer kept groups than ranks: this rank runs the update's collectives on a stand-in
        return _stand_in_collection(scored, stats, pad_token_id)
    return _kept_collection([(share, None)], stats, params.n, advantage, pad_token_id)


def _stand_in_collection(scored: ScoredGroups, stats: CollectionStats, pad_token_id: int) -> Collection:
    """Rows for a rank that was dealt no kept group: ``scored``'s, with no token in the loss or in any token metric
    (an all-false response mask, zero rewards and advantages), and no group, response or episode to report. A
    sharded policy's forward is a collective, so the rank still needs rows to run it on."""
    rows = build_rollout_batch(
        scored.rollouts,
        torch.zeros(scored.rewards.numel()),
        torch.zeros(scored.rewards.numel()),
        pad_token_id=pad_token_id,
    )
    n = scored.rollouts.n
    return Collection(
        batch=replace(rows, response_mask=torch.zeros_like(rows.response_mask)),
        items=[],
        texts=[],
        truncated=torch.zeros(0, dtype=torch.bool),
        correct=torch.zeros(0, n),
        stats=stats,
        episodes=[],
    )


def _chosen_groups(survives: list[bool], wanted: int, rank: int) -> tuple[int, list[int]]:
    """The first ``wanted`` surviving groups of every rank's, in global prompt order: how many they are, and the
    indices of this rank's among them. A collective: every rank calls it with its own ``survives``."""
    flags = distributed.all_gather_objects(survives)  # every rank's groups, in global prompt order
    offset = sum(len(f) for f in flags[:rank])
    chosen = [i for i, ok in enumerate(f for rank_flags in flags for f in rank_flags) if ok][:wanted]
    return len(chosen), [i - offset for i in chosen if offset <= i < offset + len(survives)]


def _seed_keys(batch_items: list[dict], generation_batch: int, own: int) -> list[str]:
    """Seed keys by generation batch and record id; in the first batch the drawn extras after the step's
    ``own`` prompts are marked, since a draw may repeat one of the step's own prompts."""
    marked = generation_batch == 0
    return [f"{generation_batch}/{'+' * (marked and i >= own)}{item['id']}" for i, item in enumerate(batch_items)]


def _budget_exhausted(cfg: CollectionConfig, have: int, target: int, batches: int) -> None:
    raise RuntimeError(
        f"dynamic sampling kept {have} of the step's {target} groups after {batches} generation batches "
        f"(algorithm.collection.max_generation_batches={cfg.max_generation_batches}); "
        "algorithm.collection.budget_exhausted=stop stops here, as the reference code does: raise the budget or "
        "algorithm.collection.generation_batch_multiplier, or set algorithm.collection.budget_exhausted=train to "
        "train on the groups kept"
    )


_ROLLOUT_FIELDS = (
    "prompt_ids",
    "response_ids",
    "response_logprobs",
    "texts",
    "finish_reasons",
    "policy_masks",
    "episodes",
)


def _group_data(scored: ScoredGroups, group: int) -> dict:
    """One kept group as plain data, to travel between ranks."""
    rows = range(group * scored.rollouts.n, (group + 1) * scored.rollouts.n)
    return {
        "item": scored.items[group],
        **{name: [getattr(scored.rollouts, name)[r] for r in rows] for name in _ROLLOUT_FIELDS},
        "correct": scored.correct[group].tolist(),
        "rewards": scored.rewards[group].tolist(),
    }


def _dealt_share(kept: list[tuple[int, ScoredGroups, list[int]]], rank: int) -> ScoredGroups:
    """This rank's near-equal contiguous share of all ranks' kept groups, taken in global order: generation
    batch first, then rank (each rank's prompts are the next slice of the global batch), then position."""
    mine = [(batch, _group_data(scored, g)) for batch, scored, groups in kept for g in groups]
    everyone = distributed.all_gather_objects(mine)
    tagged = [(batch, r, i, group) for r, groups in enumerate(everyone) for i, (batch, group) in enumerate(groups)]
    groups = [group for *_, group in sorted(tagged, key=lambda t: t[:3])]
    world, n = len(everyone), len(groups[0]["texts"])
    sizes = [len(groups) // world + (r < len(groups) % world) for r in range(world)]
    share = groups[sum(sizes[:rank]) : sum(sizes[: rank + 1])]
    rollouts = Rollouts(**{name: [x for g in share for x in g[name]] for name in _ROLLOUT_FIELDS}, n=n)
    return ScoredGroups(
        [g["item"] for g in share],
        rollouts,
        torch.tensor([g["correct"] for g in share], dtype=torch.float32).view(-1, n),
        torch.tensor([g["rewards"] for g in share], dtype=torch.float32).view(-1, n),
    )


def _kept_collection(
    kept: list[tuple[ScoredGroups, list[int] | None]],
    stats: CollectionStats,
    n: int,
    advantage: AdvantageConfig,
    pad_token_id: int,
) -> Collection:
    """Concatenate the kept groups (None: all of a batch's groups) and compute their advantages."""
    kept = [(scored, list(range(len(scored.items))) if groups is None else groups) for scored, groups in kept]
    rows = [[g * n + j for g in groups for j in range(n)] for _, groups in kept]
    rollouts = Rollouts(
        **{
            name: [getattr(scored.rollouts, name)[i] for (scored, _), keep in zip(kept, rows) for i in keep]
            for name in _ROLLOUT_FIELDS
        },
        n=n,
    )
    rewards = torch.cat([scored.rewards[groups] for scored, groups in kept])
    correct = torch.cat([scored.correct[groups] for scored, groups in kept])
    advantages = compute_advantages(rewards, estimator=advantage.name, eps=advantage.eps)
    batch = build_rollout_batch(rollouts, rewards.flatten(), advantages.flatten(), pad_token_id=pad_token_id)
    items = [scored.items[i] for scored, groups in kept for i in groups]
    truncated = torch.tensor([reason == "length" for reason in rollouts.finish_reasons], dtype=torch.bool)
    return Collection(
        batch=batch,
        items=items,
        texts=rollouts.texts,
        truncated=truncated,
        correct=correct,
        stats=stats,
        episodes=rollouts.episodes,
    )
