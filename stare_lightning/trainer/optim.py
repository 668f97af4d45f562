"""Optimizer and learning-rate schedule (linear warmup, then constant or cosine decay)."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from stare_lightning import distributed
from stare_lightning.config.instantiate import safe_instantiate
from stare_lightning.trainer.config import OptimConfig
from stare_lightning.trainer.loss_scale import DynamicLossScale


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
    loss_scale: DynamicLossScale | None = None,
) -> float | None:
    """Clip ``model``'s gradients to ``grad_clip`` (0: no clipping), then step unless any rank saw a non-finite
    loss (``finite`` False) or gradient norm; the gradients are cleared and the schedule advances either way.
    With a ``loss_scale`` (fp16) the gradients are unscaled first and the scale follows the outcome.
    Returns the (unscaled) gradient norm before clipping, or None when every rank skipped the step."""
    params = [p for p in model.parameters() if p.grad is not None]
    if loss_scale is not None:
        loss_scale.unscale_(params)
    norm = torch.nn.utils.clip_grad_norm_(params, grad_clip if grad_clip > 0 else math.inf)
    grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)  # a DTensor under FSDP2
    stepped = distributed.all_ranks_agree(finite and math.isfinite(grad_norm), device)
    if stepped:
        optimizer.step()
    if loss_scale is not None:
        loss_scale.update(stepped)
    optimizer.zero_grad(set_to_none=True)
    scheduler.step()
    return grad_norm if stepped else None


@dataclass
class OptimizerSteps:
    """The update loop's optimizer step: ``clip_and_step`` with the run's loss scale (fp16 only), counting and
    warning about the steps every rank skipped. Its state (the count, the loss scale) goes into checkpoints."""

    grad_clip: float
    loss_scale: DynamicLossScale | None = None
    skipped: int = 0

    def backward(self, backward: Callable[[torch.Tensor], None]) -> Callable[[torch.Tensor], None]:
        """``backward`` on the scaled loss when there is a loss scale."""
        return self.loss_scale.scaled(backward) if self.loss_scale is not None else backward

    def __call__(self, optimizer, scheduler, model, *, finite: bool, device, step: int) -> float | None:
        grad_norm = clip_and_step(
            optimizer,
            scheduler,
            model,
            grad_clip=self.grad_clip,
            finite=finite,
            device=device,
            loss_scale=self.loss_scale,
        )
        if grad_norm is None:
            self.skipped += 1
            message = f"non-finite loss or gradient at step {step}: optimizer step skipped ({self.skipped} so far)"
            if self.loss_scale is not None:
                message += f"; loss scale now {self.loss_scale.scale:g}"
            warnings.warn(message, RuntimeWarning, stacklevel=3)
        return grad_norm

    def metrics(self) -> dict[str, float]:
        """``train/nonfinite_skipped`` (steps skipped so far) and, in fp16, ``train/loss_scale``."""
        scale = {"train/loss_scale": self.loss_scale.scale} if self.loss_scale is not None else {}
        return {"train/nonfinite_skipped": float(self.skipped), **scale}

    def state_dict(self) -> dict:
        return {"skipped": self.skipped, "loss_scale": self.loss_scale.state_dict() if self.loss_scale else None}

    def load_state_dict(self, state: dict) -> None:
        self.skipped = state.get("skipped", 0)
        if self.loss_scale is not None and state.get("loss_scale") is not None:
            self.loss_scale.load_state_dict(state["loss_scale"])
