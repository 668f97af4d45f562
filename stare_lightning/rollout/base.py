"""The rollout engine protocol: what the training system needs from a generator.

An engine turns tokenised prompts into ``n`` sampled responses each, with the log-probability of every
sampled token under the engine's own copy of the policy. The trainer compares those log-probs with its
own forward pass (the mismatch canary) and pushes fresh weights into the engine after every optimizer
step through ``sync_weights``.

Seeding: sample ``j`` of prompt ``i`` is drawn from a random stream seeded ``seeds[i] + j`` (vLLM's own
convention for ``n > 1``), in every backend. With ``prompt_seeds`` keyed by record id, a prompt's samples
do not depend on which other prompts share its batch or its rank, so a run sharded over two ranks samples
what a one-rank run on the same global batch samples.

Multi-turn episodes (``rollout.episodes``) are built on ``generate``: a response may then hold tokens the
policy did not sample (a tool's output), which ``Rollouts.policy_masks`` marks, and ``Rollouts.episodes``
says how each episode went.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings shared by every backend.

    Built from a validated ``RolloutConfig`` (rollout/config.py), which checks the ranges: n >= 1,
    max_new_tokens >= 1, temperature > 0, top_p in (0, 1], top_k >= 0.
    """

    n: int = 8
    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 disables top-k
    seed: int | None = None
    # Generation also stops once the response's text contains one of these (a closed tool call); the token
    # that completes it is the response's last.
    stop: tuple[str, ...] = ()

    @property
    def truncates_support(self) -> bool:
        """True when top-p/top-k renormalise the sampling distribution (importance ratios get biased)."""
        return self.top_p < 1.0 or self.top_k > 0


FINISH_REASONS = ("stop", "length", "turns")
ENDINGS = ("answer", "turns", "tokens")


@dataclass(frozen=True)
class EpisodeStats:
    """How one response came about: a single turn by default, or an episode with tool calls."""

    turns: int = 1  # generation turns (one more than the tool calls answered, unless a budget cut it)
    tool_calls: int = 0  # calls the policy made, malformed ones included
    tool_errors: int = 0  # calls answered with an error (malformed, failed or timed out)
    tool_timeouts: int = 0
    malformed_calls: int = 0
    tool_seconds: float = 0.0
    ended_by: str = "answer"  # answer (EOS or a turn without a call), turns (max_turns), tokens (budget)
    # The episode's text turn by turn, ("policy" | "tool", text), for the rollout dump; empty for a single turn.
    segments: tuple[tuple[str, str], ...] = ()


@dataclass
class Rollouts:
    """``len(prompts) * n`` responses, grouped: rows ``[i * n, (i + 1) * n)`` answer prompt ``i``.

    ``policy_masks[r][t]`` is False where token ``t`` of response ``r`` was not sampled by the policy (a tool
    output); its log-prob there is 0. Left out (None), every token was sampled and every row is one turn.
    """

    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    response_logprobs: list[list[float]]
    texts: list[str]
    finish_reasons: list[str]  # "stop" (EOS or stop string), "length" (token budget), "turns" (tool-call budget)
    n: int
    generation_seconds: float = 0.0
    tool_seconds: float = 0.0  # wall time spent in tool calls (not in generation_seconds)
    policy_masks: list[list[bool]] | None = None
    episodes: list[EpisodeStats] | None = None

    def __post_init__(self) -> None:
        rows = len(self.response_ids)
        if rows % self.n:
            raise ValueError(f"{rows} responses cannot be grouped by n={self.n}")
        if self.policy_masks is None:
            self.policy_masks = [[True] * len(r) for r in self.response_ids]
        if self.episodes is None:
            self.episodes = [EpisodeStats()] * rows
        for name in ("prompt_ids", "response_logprobs", "texts", "finish_reasons", "policy_masks", "episodes"):
            if len(getattr(self, name)) != rows:
                raise ValueError(f"Rollouts.{name} has {len(getattr(self, name))} rows, expected {rows}")
        for row, (mask, response) in enumerate(zip(self.policy_masks, self.response_ids)):
            if len(mask) != len(response):
                raise ValueError(f"Rollouts.policy_masks[{row}] has {len(mask)} entries for {len(response)} tokens")

    @property
    def num_groups(self) -> int:
        return len(self.response_ids) // self.n

    @property
    def num_tokens(self) -> int:
        """Tokens the engine generated (tool outputs excluded)."""
        return sum(sum(mask) for mask in self.policy_masks)


@dataclass(frozen=True)
class Sample:
    """One sampled response as an engine returns it: token ids, their log-probs, the text and why it ended."""

    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str


def check_prompts(prompt_ids: Sequence[Sequence[int]]) -> None:
    """What every engine asks of its prompts before generating: at least one token each."""
    empty = [i for i, prompt in enumerate(prompt_ids) if len(prompt) == 0]
    if empty:
        raise ValueError(f"Every prompt needs at least one token: prompts {empty[:8]} are empty")


def rollouts_from_samples(
    engine: str, prompt_ids: Sequence[Sequence[int]], samples: Sequence[Sequence[Sample]], n: int, seconds: float
) -> Rollouts:
    """The grouped ``Rollouts`` of ``samples[i]``, the ``n`` samples of prompt ``i``, each checked: ``n`` per prompt,
    a single-turn finish reason, a log-prob per token. ``engine`` names the engine in an error."""
    rows, responses, logprobs, texts, reasons = [], [], [], [], []
    for prompt, group in zip(prompt_ids, samples):
        if len(group) != n:
            raise RuntimeError(f"{engine} returned {len(group)} samples for a prompt, expected {n}")
        for sample in group:
            if sample.finish_reason not in ("stop", "length"):
                raise RuntimeError(f"{engine} ended a request with finish_reason={sample.finish_reason!r}")
            if len(sample.logprobs) != len(sample.token_ids):
                raise RuntimeError(f"{engine} returned no log-prob for some sampled tokens")
            rows.append(list(prompt))
            responses.append(list(sample.token_ids))
            logprobs.append(list(sample.logprobs))
            texts.append(sample.text)
            reasons.append(sample.finish_reason)
    return Rollouts(rows, responses, logprobs, texts, reasons, n, generation_seconds=seconds)  # fields in order


@runtime_checkable
class RolloutEngine(Protocol):
    """A generator of grouped samples. Implementations: ``hf.HFRolloutEngine``, ``vllm.VLLMRolloutEngine``,
    ``server.trainer_side.engine.ServerRolloutEngine``; ``rollout/backends.py`` lists the backends that build them.

    Engines also carry a class attribute ``holds_weight_copy``: True when the engine keeps its own copy of
    the weights (vLLM), so ``sync_weights`` must follow every optimizer step; False when it samples from the
    trained module itself (HF ``generate``), where syncing is a no-op.
    """

    def generate(
        self,
        prompt_ids: list[list[int]],
        params: SamplingParams,
        seeds: Sequence[int] | None = None,
        max_new_tokens: Sequence[int] | None = None,
    ) -> Rollouts:
        """Sample ``params.n`` responses for each prompt (token ids without padding).

        ``seeds``: one per prompt (see ``request_seeds``); without them they derive from ``params.seed``.
        ``max_new_tokens``: one budget per prompt, in place of ``params.max_new_tokens``.
        """
        ...

    def sync_weights(self, model: torch.nn.Module) -> None:
        """Load the trainer's current weights. Called after every optimizer step, on every rank, in the same order."""
        ...

    def sleep(self) -> None:
        """Release memory between rollouts where the backend can; weights synced so far must survive."""
        ...

    def wake(self) -> None: ...

    def close(self) -> None: ...


def prompt_seeds(base_seed: int, keys: Sequence[str], n: int) -> list[int]:
    """One seed per prompt from a base seed and a key naming the prompt (record id, generation batch).

    A hash rather than a position in the batch: the seed follows the prompt wherever it is sampled. The
    range leaves room for the ``n`` consecutive per-sample seeds below 2**31.
    """
    seeds = []
    for key in keys:
        digest = hashlib.blake2b(f"{base_seed}/{key}".encode(), digest_size=8).digest()
        seeds.append(int.from_bytes(digest, "little") % (2**31 - n))
    return seeds


def request_budgets(params: SamplingParams, num_prompts: int, budgets: Sequence[int] | None) -> list[int]:
    """The per-prompt token budgets an engine uses: the caller's (each >= 1), else ``params.max_new_tokens``."""
    if budgets is None:
        return [params.max_new_tokens] * num_prompts
    if len(budgets) != num_prompts or any(int(b) < 1 for b in budgets):
        raise ValueError(f"max_new_tokens needs one budget >= 1 per prompt ({num_prompts}), got {list(budgets)}")
    return [int(b) for b in budgets]


def request_seeds(params: SamplingParams, num_prompts: int, seeds: Sequence[int] | None) -> list[int | None]:
    """The per-prompt seeds an engine uses: the caller's, else spread from ``params.seed``, else unseeded."""
    if seeds is not None:
        if len(seeds) != num_prompts:
            raise ValueError(f"got {len(seeds)} seeds for {num_prompts} prompts: pass one seed per prompt")
        return [int(s) for s in seeds]
    if params.seed is None:
        return [None] * num_prompts
    # Spread over 31 bits: every (prompt, sample) stream stays distinct within a call and across nearby seeds.
    rng = random.Random(params.seed)
    return [rng.randrange(0, 2**31 - params.n) for _ in range(num_prompts)]
