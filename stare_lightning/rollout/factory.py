"""Choose and build the rollout engine named by ``rollout.backend``."""

from __future__ import annotations

import torch

from stare_lightning.rollout.config import RolloutConfig


def vllm_available() -> bool:
    from stare_lightning.rollout.vllm import vllm_import_error

    return vllm_import_error() is None


def resolve_backend(backend: str) -> str:
    """``auto`` means vLLM wherever it is installed, HF generate otherwise."""
    if backend == "auto":
        return "vllm" if vllm_available() else "hf"
    return backend


def build_engine(
    cfg: RolloutConfig,
    policy: torch.nn.Module,
    tokenizer,
    model_dir: str,
    *,
    seed: int = 0,
    compute_dtype: torch.dtype | None = None,
):
    """``compute_dtype``: the dtype the trainer computes in (vLLM runs in it, so both see the same
    numerics); by default the policy parameters' dtype."""
    backend = resolve_backend(cfg.backend)
    if backend == "hf":
        from stare_lightning.rollout.hf import HFRolloutEngine

        return HFRolloutEngine(policy, tokenizer)
    from stare_lightning.rollout.vllm import VLLMRolloutEngine

    dtype = str(compute_dtype or next(policy.parameters()).dtype).removeprefix("torch.")
    return VLLMRolloutEngine(
        model_dir,
        dtype=dtype,
        gpu_memory_utilization=cfg.gpu_memory_utilization,
        tensor_parallel_size=cfg.tensor_parallel_size,
        enable_sleep_mode=cfg.enable_sleep_mode,
        seed=seed,
    )
