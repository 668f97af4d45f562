"""The rollout engine protocol: what the training system needs from a generator.

An engine turns tokenised prompts into ``n`` sampled responses each, with the log-probability of every
sampled token under the engine's own copy of the policy. The trainer compares those log-probs with its
own forward pass (the mismatch canary) and pushes fresh weights into the engine after every optimizer
step through ``sync_weights``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings shared by every backend."""

    n: int = 8
    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 disables top-k
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"rollout.n must be >= 1, got {self.n}")
        if self.max_new_tokens < 1:
            raise ValueError(f"rollout.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not self.temperature > 0:
            raise ValueError(f"rollout.temperature must be > 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"rollout.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"rollout.top_k must be >= 0 (0 disables it), got {self.top_k}")

    @property
    def truncates_support(self) -> bool:
        """True when top-p/top-k renormalise the sampling distribution (importance ratios get biased)."""
        return self.top_p < 1.0 or self.top_k > 0


@dataclass
class Rollouts:
    """``len(prompts) * n`` responses, grouped: rows ``[i * n, (i + 1) * n)`` answer prompt ``i``."""

    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    response_logprobs: list[list[float]]
    texts: list[str]
    finish_reasons: list[str]  # "stop" (EOS or stop string) or "length"
    n: int
    generation_seconds: float = 0.0
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        rows = len(self.response_ids)
        if rows % self.n:
            raise ValueError(f"{rows} responses cannot be grouped by n={self.n}")
        for name in ("prompt_ids", "response_logprobs", "texts", "finish_reasons"):
            if len(getattr(self, name)) != rows:
                raise ValueError(f"Rollouts.{name} has {len(getattr(self, name))} rows, expected {rows}")

    @property
    def num_groups(self) -> int:
        return len(self.response_ids) // self.n

    @property
    def num_tokens(self) -> int:
        return sum(len(r) for r in self.response_ids)


@runtime_checkable
class RolloutEngine(Protocol):
    """A generator of grouped samples. Implementations: ``hf.HFRolloutEngine``, ``vllm.VLLMRolloutEngine``.

    Engines also carry a class attribute ``holds_weight_copy``: True when the engine keeps its own copy of
    the weights (vLLM), so ``sync_weights`` must follow every optimizer step; False when it samples from the
    trained module itself (HF ``generate``), where syncing is a no-op.
    """

    def generate(self, prompt_ids: list[list[int]], params: SamplingParams) -> Rollouts:
        """Sample ``params.n`` responses for each prompt (token ids without padding)."""
        ...

    def sync_weights(self, model: torch.nn.Module) -> None:
        """Load the trainer's current weights. Called after every optimizer step, on every rank, in the same order."""
        ...

    def sleep(self) -> None:
        """Release memory between rollouts where the backend can; weights synced so far must survive."""
        ...

    def wake(self) -> None:
        ...

    def close(self) -> None:
        ...
