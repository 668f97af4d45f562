"""``RolloutConfig``: the typed ``rollout`` config group (sampling and the engine), checked in ``__post_init__``.

``SamplingParams`` (rollout/base.py) is built from a validated ``RolloutConfig`` and repeats none of its checks.
"""

from __future__ import annotations

from dataclasses import dataclass

from stare_lightning.config.checks import choice, flag, number
from stare_lightning.rollout.base import SamplingParams

BACKENDS = ("auto", "vllm", "hf")


@dataclass
class RolloutConfig:
    backend: str = "auto"  # auto: vLLM where installed, else HF generate
    n: int = 8
    max_new_tokens: int = 32
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 disables top-k
    val_n: int = 4
    val_temperature: float = 1.0
    val_top_p: float = 1.0
    gpu_memory_utilization: float = 0.3
    tensor_parallel_size: int = 1
    enable_sleep_mode: bool = False
    canary_threshold: float = 0.05
    canary_patience: int = 3

    def __post_init__(self) -> None:
        p = "rollout."
        choice(f"{p}backend", self.backend, BACKENDS)
        for key in ("n", "max_new_tokens", "val_n", "tensor_parallel_size", "canary_patience"):
            number(f"{p}{key}", getattr(self, key), low=1, integer=True)
        if self.n < 2:
            raise ValueError(f"{p}n={self.n} is out of range: must be >= 2 for group-relative advantages")
        number(f"{p}top_k", self.top_k, low=0, integer=True)
        for key in ("temperature", "val_temperature", "canary_threshold"):
            number(f"{p}{key}", getattr(self, key), low=0.0, low_open=True)
        for key in ("top_p", "val_top_p", "gpu_memory_utilization"):
            number(f"{p}{key}", getattr(self, key), low=0.0, high=1.0, low_open=True)
        flag(f"{p}enable_sleep_mode", self.enable_sleep_mode)

    def training_sampling(self) -> SamplingParams:
        """How training rollouts are sampled: ``n`` per prompt at ``temperature``, ``top_p``, ``top_k``."""
        return SamplingParams(
            n=self.n,
            max_new_tokens=self.max_new_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
        )

    def validation_sampling(
        self,
        n: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        max_new_tokens: int | None = None,
    ) -> SamplingParams:
        """How validation samples are drawn: ``val_n`` per prompt at ``val_temperature`` and ``val_top_p``, each
        replaced by the argument of the same meaning when one is given (a benchmark's own settings)."""
        return SamplingParams(
            n=self.val_n if n is None else n,
            max_new_tokens=self.max_new_tokens if max_new_tokens is None else max_new_tokens,
            temperature=self.val_temperature if temperature is None else temperature,
            top_p=self.val_top_p if top_p is None else top_p,
        )
