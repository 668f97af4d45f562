"""Choose and build the rollout engine named by ``rollout.backend``."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

import torch

from stare_lightning.rollout.config import RolloutConfig, check_engine_kwargs

logger = logging.getLogger(__name__)


def vllm_available() -> bool:
    from stare_lightning.rollout.vllm import vllm_import_error

    return vllm_import_error() is None


def resolve_backend(backend: str) -> str:
    """``auto`` means vLLM wherever it is installed, HF generate otherwise (said in a warning: far slower)."""
    if backend != "auto":
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
):
    """``compute_dtype``: the dtype the trainer computes in (vLLM runs in it, so both see the same
    numerics); by default the policy parameters' dtype. ``cfg.engine_kwargs`` are checked against the
    installed vLLM before the engine is built, then passed to ``vllm.LLM``. ``log_dir``: where servers the run
    starts (``rollout.backend=server``) write their logs."""
    backend = resolve_backend(cfg.backend)
    if backend == "vllm":  # a misspelt engine argument is named before anything is loaded or started
        check_engine_kwargs(cfg.engine_kwargs)
    if backend != "hf":
        dtype = str(compute_dtype or next(policy.parameters()).dtype).removeprefix("torch.")
    if backend == "server":
        from stare_lightning.rollout.server.connect import connect_servers

        logs = Path(log_dir) if log_dir is not None else Path.cwd() / "servers"
        return connect_servers(cfg.server, model_dir, dtype=dtype, seed=seed, log_dir=logs)
    if backend == "hf":
        from stare_lightning.rollout.hf import HFRolloutEngine

        if cfg.engine_kwargs:  # rollout.backend=auto without a usable vLLM (backend=hf refuses them outright)
            warnings.warn(
                f"rollout.engine_kwargs {sorted(cfg.engine_kwargs)} are ignored: vLLM is not usable here, "
                "so rollouts use the HF engine",
                stacklevel=2,
            )
        return HFRolloutEngine(policy, tokenizer)
    from stare_lightning.rollout.vllm import VLLMRolloutEngine

    return VLLMRolloutEngine(
        model_dir,
        dtype=dtype,
        gpu_memory_utilization=cfg.gpu_memory_utilization,
        tensor_parallel_size=cfg.tensor_parallel_size,
        enable_sleep_mode=cfg.enable_sleep_mode,
        seed=seed,
        **cfg.engine_kwargs,
    )


class SyncedEngine:
    """The rollout engine of a training run: built on first use, given the policy's weights whenever they
    changed (``mark_stale`` after each optimizer step, then ``get`` syncs), closed at the end of the run."""

    def __init__(self, cfg: RolloutConfig, tokenizer, model_dir: str, *, seed: int) -> None:
        self.cfg, self.tokenizer, self.model_dir, self.seed = cfg, tokenizer, model_dir, seed
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
