"""Typed schemas for every config group, checked before anything expensive starts.

Hydra composes YAML from ``conf/``; ``to_run_config`` merges it onto these dataclasses, so an unknown key
or a wrongly typed value fails with the key's full name, and each ``__post_init__`` checks ranges and
choices. Groups whose entries are plain constructor calls (trainer, callbacks, logger) keep their
``_target_`` form and are checked by ``safe_instantiate``'s allow-list instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf

from stare_lightning.algorithms.config import AlgorithmConfig
from stare_lightning.data.config import DataConfig


def _choice(key: str, value: Any, allowed: tuple) -> None:
    if value not in allowed:
        raise ValueError(f"{key}={value!r} is not allowed; choose one of {list(allowed)}")


def _positive(key: str, value: float, *, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{key} must be {'>= 0' if allow_zero else '> 0'}, got {value}")


@dataclass
class ColdStartConfig:
    """Supervised warm-up of the built-in tiny model on the built-in task (cached by its settings)."""

    steps: int = 400
    batch_size: int = 64
    lr: float = 3e-3
    seed: int = 0

    def __post_init__(self) -> None:
        _positive("model.cold_start.steps", self.steps, allow_zero=True)
        _positive("model.cold_start.batch_size", self.batch_size)
        _positive("model.cold_start.lr", self.lr)


@dataclass
class ModelConfig:
    name_or_path: str = "tiny"
    dtype: str = "float32"
    cold_start: Optional[ColdStartConfig] = None
    gradient_checkpointing: bool = False
    cache_dir: Optional[str] = None

    def __post_init__(self) -> None:
        _choice("model.dtype", self.dtype, ("float32", "bfloat16", "float16"))
        if self.cold_start is not None and self.name_or_path != "tiny":
            raise ValueError(
                f"model.cold_start is only for the built-in tiny model, but model.name_or_path={self.name_or_path!r}"
            )


@dataclass
class RolloutConfig:
    backend: str = "auto"  # auto: vLLM where installed, else HF generate
    n: int = 8
    max_new_tokens: int = 32
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    val_n: int = 4
    val_temperature: float = 1.0
    val_top_p: float = 1.0
    gpu_memory_utilization: float = 0.3
    tensor_parallel_size: int = 1
    enable_sleep_mode: bool = False
    canary_threshold: float = 0.05
    canary_patience: int = 3
    mismatch_correction: str = "none"  # none | token | sequence
    mismatch_mode: str = "truncate"  # truncate | mask
    mismatch_cap: float = 2.0

    def __post_init__(self) -> None:
        _choice("rollout.backend", self.backend, ("auto", "vllm", "hf"))
        _choice("rollout.mismatch_correction", self.mismatch_correction, ("none", "token", "sequence"))
        _choice("rollout.mismatch_mode", self.mismatch_mode, ("truncate", "mask"))
        for key in ("n", "max_new_tokens", "val_n", "tensor_parallel_size", "canary_patience"):
            if getattr(self, key) < 1:
                raise ValueError(f"rollout.{key} must be >= 1, got {getattr(self, key)}")
        for key in ("temperature", "val_temperature", "canary_threshold", "mismatch_cap"):
            _positive(f"rollout.{key}", getattr(self, key))
        for key in ("top_p", "val_top_p", "gpu_memory_utilization"):
            if not 0 < getattr(self, key) <= 1:
                raise ValueError(f"rollout.{key} must be in (0, 1], got {getattr(self, key)}")
        if self.n < 2:
            raise ValueError(f"rollout.n must be >= 2 for group-relative advantages, got {self.n}")


@dataclass
class OptimConfig:
    optimizer: str = "torch.optim.AdamW"
    lr: float = 1e-6
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    warmup_steps: int = 0
    schedule: str = "constant"  # constant | cosine
    min_lr_ratio: float = 0.0
    grad_clip: float = 1.0  # 0 disables clipping
    micro_batch_tokens: int = 8192
    logprob_chunk_size: int = 1024

    def __post_init__(self) -> None:
        _choice("optim.schedule", self.schedule, ("constant", "cosine"))
        _positive("optim.lr", self.lr)
        _positive("optim.weight_decay", self.weight_decay, allow_zero=True)
        _positive("optim.warmup_steps", self.warmup_steps, allow_zero=True)
        _positive("optim.grad_clip", self.grad_clip, allow_zero=True)
        _positive("optim.micro_batch_tokens", self.micro_batch_tokens)
        _positive("optim.logprob_chunk_size", self.logprob_chunk_size)
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"optim.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")


@dataclass
class ValidationConfig:
    pass_k: list[int] = field(default_factory=lambda: [1, 4])
    reflection_words: Optional[list[str]] = None  # None: the default list of the metrics package
    before_fit: bool = True  # validate the starting policy so the summary shows the gain

    def __post_init__(self) -> None:
        if any(k < 1 for k in self.pass_k):
            raise ValueError(f"validation.pass_k values must be >= 1, got {self.pass_k}")


@dataclass
class RunConfig:
    """The whole run. ``trainer``, ``callbacks`` and ``logger`` are ``_target_`` mappings."""

    seed: int = 0
    output_dir: Optional[str] = None  # filled in from Hydra's run directory by the CLI
    summary: bool = True
    allowed_targets: list[str] = field(default_factory=list)
    ckpt_path: Optional[str] = None
    export_dir: Optional[str] = None
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    trainer: Any = None
    callbacks: Any = None
    logger: Any = None

    def __post_init__(self) -> None:
        k_max = max(self.validation.pass_k)
        if k_max > self.rollout.val_n:
            raise ValueError(f"validation.pass_k={self.validation.pass_k} has k > rollout.val_n={self.rollout.val_n}")


def to_run_config(cfg: DictConfig) -> RunConfig:
    """Merge a composed config onto the schema and build the validated dataclasses.

    Hydra's own keys are dropped; anything else unknown is an error naming the key.
    """
    cfg = OmegaConf.masked_copy(cfg, [k for k in cfg.keys() if k != "hydra"]) if "hydra" in cfg else cfg
    merged = OmegaConf.merge(OmegaConf.structured(RunConfig), cfg)
    return OmegaConf.to_object(merged)


SCHEMA_NAME = "stare_lightning_schema"


def register_schema() -> None:
    """Make ``RunConfig`` the base of ``conf/config.yaml`` (its first default), so composition knows every key."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name=SCHEMA_NAME, node=RunConfig)


register_schema()
