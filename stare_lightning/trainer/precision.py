"""Which dtype the trainer's forward passes compute in, so the rollout engine can match it."""

from __future__ import annotations

import torch


def compute_dtype(strategy, precision: str, model: torch.nn.Module) -> torch.dtype:
    """FSDP2's ``param_dtype`` when the strategy mixes precision, else Lightning's half precision (``bf16-*``,
    ``16-*``), else the dtype of ``model``'s weights."""
    mp_policy = getattr(strategy, "mixed_precision_policy", None)
    if mp_policy is not None:
        return mp_policy.param_dtype
    precision = str(precision)
    if precision.startswith("bf16"):
        return torch.bfloat16
    if precision.startswith("16"):
        return torch.float16
    return next(model.parameters()).dtype
