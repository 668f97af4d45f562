"""Build the rollout engine of the backend ``rollout.backend`` names (``auto``: vLLM where usable, else HF)."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

import torch

from stare_lightning.models.config import LoraConfig
from stare_lightning.rollout.backends import AUTO, ROLLOUT_BACKENDS, EngineContext
from stare_lightning.rollout.config import RolloutConfig
from stare_lightning.rollout.lora_sync import adapter_sync

logger = logging.getLogger(__name__)


def vllm_available() -> bool:
    from stare_lightning.rollout.vllm import vllm_import_error

    return vllm_import_error() is None


def resolve_backend(backend: str) -> str:
    """``auto`` means vLLM wherever it is installed, HF generate otherwise (said in a warning: far slower)."""
    if backend != AUTO:
        return backend
    from stare_lightning.rollout.vllm import vllm_import_error

    reason = vllm_import_error()
    if reason is None:
        return "vllm"
    logger.warning(
        "rollout=auto: vLLM is not usable here (%s), so rollouts use the HF engine (much slower); `make install` "
        "installs vLLM, rollout=hf chooses HF without this warning",
        reason,
    )
    return "hf"


def build_engine(
    cfg: RolloutConfig,
    policy: torch.nn.Module,
    tokenizer,
    model_dir: str,
    *,
    seed: int = 0,
    compute_dtype: torch.dtype | None = None,
    log_dir: Path | None = None,
    lora: LoraConfig | None = None,
):
    """The engine of the backend ``rollout.backend`` names (``rollout/backends.py``). ``compute_dtype``: the dtype
    the trainer computes in (an engine with its own weights runs in it, so both see the same numerics); by default
    the policy parameters' dtype. ``log_dir``: where a backend that starts processes writes their logs. ``lora``:
    the policy's adapters, which ``rollout.lora_sync`` decides how to sync."""
    name = resolve_backend(cfg.backend)
    backend = ROLLOUT_BACKENDS[name]
    # rollout.backend=auto without a usable vLLM (a backend named outright refuses them at config time)
    if cfg.engine_kwargs and not backend.engine_kwargs:
        warnings.warn(
            f"rollout.engine_kwargs {sorted(cfg.engine_kwargs)} are ignored: vLLM is not usable here, "
            f"so rollouts use the {name} engine",
            stacklevel=2,
        )
    dtype = compute_dtype or (next(policy.parameters()).dtype if policy is not None else None)
    dtype = None if dtype is None else str(dtype).removeprefix("torch.")
    logs = Path(log_dir) if log_dir is not None else Path.cwd() / "servers"
    adapters = adapter_sync(cfg, lora, backend)
    context = EngineContext(policy, tokenizer, model_dir, seed, dtype, log_dir=logs, adapters=adapters)
    return backend.build(cfg, context)


class SyncedEngine:
    """The rollout engine of a training run: built on first use, given the policy's weights whenever they
    changed (``mark_stale`` after each optimizer step, then ``get`` syncs), closed at the end of the run."""

    def __init__(self, cfg: RolloutConfig, tokenizer, model_dir: str, *, seed: int, lora: LoraConfig | None = None):
        self.cfg, self.tokenizer, self.model_dir, self.seed, self.lora = cfg, tokenizer, model_dir, seed, lora
        self.engine = None
        self.stale = True

    def get(self, policy: torch.nn.Module, compute_dtype: torch.dtype | None = None, log_dir: Path | None = None):
        """The engine holding ``policy``'s current weights (``compute_dtype`` and ``log_dir`` apply when it is
        built)."""
        # Validation runs under inference mode; an engine built or synced there would hold inference tensors
        # that a later sync during training may not update in place.
        with torch.inference_mode(False):
            if self.engine is None:
                self.engine = build_engine(
                    self.cfg,
                    policy,
                    self.tokenizer,
                    self.model_dir,
                    seed=self.seed,
                    compute_dtype=compute_dtype,
                    log_dir=log_dir,
                    lora=self.lora,
                )
                self.stale = getattr(self.engine, "holds_weight_copy", True)
            if self.stale:
                self.engine.sync_weights(policy)
                self.stale = False
        return self.engine

    def mark_stale(self) -> None:
        self.stale = True

    def sleep(self) -> None:
        """Release the engine's GPU memory for the update (level 1: the next sync restores, then overwrites,
        the weights; the next rollout wakes the KV cache). Nothing without ``rollout.enable_sleep_mode``."""
        if self.engine is not None and self.cfg.enable_sleep_mode:
            self.engine.sleep()

    def close(self) -> None:
        """Free the engine (a sweep can then start the next run's engine in this process)."""
        if self.engine is not None:
            self.engine.close()
        self.engine, self.stale = None, True
