"""Dynamic loss scaling for fp16 training (FSDP2 with ``trainer.strategy.param_dtype=float16``).

fp16 keeps 10 mantissa bits but only 5 exponent bits: gradients of a language model's loss fall below its
smallest normal number (6e-5) and flush to zero. The loss is multiplied by a large scale before backward and the
gradients divided by it before clipping and the optimizer step. The schedule is ``torch.amp.GradScaler``'s (and
the reference code's sharded grad scaler's): start at 2^16; a step whose gradients overflow is skipped and halves
the scale; 2000 steps in a row without one double it.

Departure from ``GradScaler``: the overflow check is the all-reduced gradient norm that clipping computes anyway,
not each device's own check of its gradient shards, so every rank of a sharded run skips the same steps and keeps
the same scale (what a sharded grad scaler gets by all-reducing its found-inf flags).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass

import torch


@dataclass
class DynamicLossScale:
    scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    steps_since_overflow: int = 0

    def scaled(self, backward: Callable[[torch.Tensor], None]) -> Callable[[torch.Tensor], None]:
        """``backward`` applied to the loss times the current scale (in fp32: 2^16 is past fp16's largest number)."""
        return lambda loss: backward(loss.float() * self.scale)

    def unscale_(self, parameters: Iterable[torch.nn.Parameter]) -> None:
        """Divide every gradient by the scale its loss was multiplied by (in place)."""
        inverse = 1.0 / self.scale
        for parameter in parameters:
            if parameter.grad is not None:
                parameter.grad.mul_(inverse)

    def update(self, finite: bool) -> None:
        """After a step: back off on an overflow (the step was skipped), grow after ``growth_interval`` good ones."""
        if not finite:
            self.scale *= self.backoff_factor
            self.steps_since_overflow = 0
            return
        self.steps_since_overflow += 1
        if self.steps_since_overflow == self.growth_interval:
            self.scale *= self.growth_factor
            self.steps_since_overflow = 0

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for name, value in state.items():
            setattr(self, name, value)


def loss_scale_for(strategy: object) -> DynamicLossScale | None:
    """A loss scale where the strategy computes in fp16 (FSDP2's ``param_dtype``); bf16 and fp32 keep fp32's
    exponent range and need none. (Lightning's ``16-*`` precisions are refused at config time: its own scaler
    steps through ``LightningOptimizer``, which this project's manual update loop does not use.)"""
    policy = getattr(strategy, "mixed_precision_policy", None)
    return DynamicLossScale() if policy is not None and policy.param_dtype == torch.float16 else None
