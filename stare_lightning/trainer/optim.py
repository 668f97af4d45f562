"""Optimizer and learning-rate schedule (linear warmup, then constant or cosine decay)."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from stare_lightning import distributed
from stare_lightning.config.instantiate import safe_instantiate
from stare_lightning.trainer.config import OptimConfig


def lr_multiplier(step: int, *, warmup_steps: int, total_steps: int, schedule: str, min_lr_ratio: float) -> float:
    """Factor applied to the base learning rate at optimizer step ``step`` (0-based)."""
    if warmup_steps and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    decay_steps = max(total_steps - warmup_steps, 1)
    progress = min(max(step - warmup_steps, 0) / decay_steps, 1.0)
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_optimizer(
    params: Iterable[torch.nn.Parameter], cfg: OptimConfig, *, total_steps: int, extra_allowed: list[str] = ()
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    optimizer = safe_instantiate(
        {
            "_target_": cfg.optimizer,
            "lr": cfg.lr,
            "weight_decay": cfg.weight_decay,
            "betas": tuple(cfg.betas),
            "eps": cfg.eps,
            **({"fused": True} if cfg.use_fused() else {}),
        },
        [p for p in params if p.requires_grad],  # frozen weights (LoRA's base) take no optimizer state
        extra_allowed=extra_allowed,
        where="optim.optimizer",
    )
    schedule = lambda step: lr_multiplier(  # noqa: E731
        step,
        warmup_steps=cfg.warmup_steps,
        total_steps=total_steps,
        schedule=cfg.schedule,
        min_lr_ratio=cfg.min_lr_ratio,
    )
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)


def clip_and_step(
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    model: torch.nn.Module,
    *,
    grad_clip: float,
    finite: bool,
    device: torch.device | None = None,
) -> float | None:
    """Clip ``model``'s gradients to ``grad_clip`` (0: no clipping), then step unless any rank saw a non-finite
    loss (``finite`` False) or gradient norm; the gradients are cleared and the schedule advances either way.
    Returns the gradient norm before clipping, or None when every rank skipped the step."""
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, grad_clip if grad_clip > 0 else math.inf)
    grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)  # a DTensor under FSDP2
    stepped = distributed.all_ranks_agree(finite and math.isfinite(grad_norm), device)
    if stepped:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    scheduler.step()
    return grad_norm if stepped else None
