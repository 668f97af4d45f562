"""``OptimConfig``: the typed ``optim`` group (optimizer, schedule, clipping), checked in ``__post_init__``."""

from __future__ import annotations

from dataclasses import dataclass, field

from stare_lightning.config.checks import choice, flag, number, text

SCHEDULES = ("constant", "cosine")
# The optimizers here with a fused (one kernel over all parameters) implementation on CPU and GPU.
FUSED_OPTIMIZERS = ("torch.optim.Adam", "torch.optim.AdamW")


@dataclass
class OptimConfig:
    optimizer: str = "torch.optim.AdamW"
    """The optimizer class, a `_target_` name checked against the allow-list."""
    lr: float = 1e-6
    """Peak learning rate."""
    weight_decay: float = 0.0
    """Decoupled weight decay (AdamW)."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """Adam's moment decay rates."""
    eps: float = 1e-8
    """Adam's epsilon."""
    warmup_steps: int = 0
    """Optimizer steps of linear warm-up from 0."""
    schedule: str = "constant"
    """The learning rate after warm-up."""
    min_lr_ratio: float = 0.0
    """`cosine`: the last learning rate, as a share of `lr`."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this (0: measure it only)."""
    # The optimizer's fused implementation: one pass over every parameter instead of a loop of small kernels (on a
    # CPU, AdamW's step over 135M parameters takes 0.2 s instead of 0.9 s); the same update within fp32 rounding.
    # None (the default): on where the optimizer has one (FUSED_OPTIMIZERS); true insists, false turns it off.
    fused: bool | None = None
    """The optimizer's fused implementation (one pass over all parameters); null: where it has one."""

    def __post_init__(self) -> None:
        p = "optim."
        text(f"{p}optimizer", self.optimizer)
        choice(f"{p}schedule", self.schedule, SCHEDULES)
        number(f"{p}lr", self.lr, low=0.0, low_open=True)
        number(f"{p}weight_decay", self.weight_decay, low=0.0)
        if len(self.betas) != 2:
            raise ValueError(f"{p}betas={list(self.betas)!r} is not allowed: must be two numbers in [0.0, 1.0)")
        for i, beta in enumerate(self.betas):
            number(f"{p}betas[{i}]", beta, low=0.0, high=1.0, high_open=True)
        number(f"{p}eps", self.eps, low=0.0, low_open=True)
        number(f"{p}warmup_steps", self.warmup_steps, low=0, integer=True)
        number(f"{p}min_lr_ratio", self.min_lr_ratio, low=0.0, high=1.0)
        number(f"{p}grad_clip", self.grad_clip, low=0.0)
        if self.fused is not None:
            flag(f"{p}fused", self.fused)
        if self.fused and self.optimizer not in FUSED_OPTIMIZERS:
            raise ValueError(
                f"{p}fused=true needs an optimizer with a fused implementation, one of {list(FUSED_OPTIMIZERS)}; "
                f"{p}optimizer={self.optimizer!r}: set {p}fused=false"
            )

    def use_fused(self) -> bool:
        """Whether the optimizer is built with its fused implementation."""
        return self.optimizer in FUSED_OPTIMIZERS if self.fused is None else self.fused
