"""The optimizer and schedule: the fused AdamW takes the steps of the default one, the warmup-then-cosine
multiplier matches its formula at its ends, and settings that would do nothing are refused."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from stare_lightning.trainer.config import OptimConfig
from stare_lightning.trainer.optim import build_optimizer, lr_multiplier


def _train(model: torch.nn.Module, cfg: OptimConfig, steps: int = 4) -> torch.nn.Module:
    optimizer, scheduler = build_optimizer(model.parameters(), cfg, total_steps=steps)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        inputs = torch.randn(16, 12, generator=g)
        loss = model(inputs).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
    return model


def test_fused_adamw_takes_the_same_steps():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.Tanh(), torch.nn.Linear(32, 5))
    cfg = OptimConfig(lr=1e-2, weight_decay=0.01, warmup_steps=1, schedule="cosine")
    plain = _train(copy.deepcopy(model), cfg)
    fused = _train(copy.deepcopy(model), OptimConfig(**{**cfg.__dict__, "fused": True}))
    moved = max(float((p - q).abs().max()) for p, q in zip(plain.parameters(), model.parameters()))
    assert moved > 1e-3  # the steps did something
    for p, q in zip(plain.parameters(), fused.parameters()):
        torch.testing.assert_close(q, p, atol=1e-6, rtol=1e-5)


def test_the_fused_optimizer_is_the_fused_implementation():
    model = torch.nn.Linear(3, 3)
    optimizer, _ = build_optimizer(model.parameters(), OptimConfig(fused=True), total_steps=1)
    assert optimizer.defaults["fused"] is True


def test_the_fused_implementation_is_the_default_where_there_is_one():
    model = torch.nn.Linear(3, 3)
    for optimizer, fused, built in [
        ("torch.optim.AdamW", None, True),
        ("torch.optim.AdamW", False, False),
        ("torch.optim.Adamax", None, False),  # no fused implementation: the default does not insist
    ]:
        cfg = OptimConfig(optimizer=optimizer, fused=fused)
        made, _ = build_optimizer(model.parameters(), cfg, total_steps=1)
        assert bool(made.defaults.get("fused")) is built, (optimizer, fused)


def test_a_fused_optimizer_without_a_fused_implementation_is_refused():
    with pytest.raises(ValueError, match=r"optim.fused=true needs an optimizer with a fused implementation"):
        OptimConfig(optimizer="torch.optim.RMSprop", fused=True)


def test_warmup_then_cosine_ends():
    kwargs = dict(warmup_steps=4, total_steps=14, schedule="cosine", min_lr_ratio=0.1)
    assert lr_multiplier(0, **kwargs) == pytest.approx(0.25)
    assert lr_multiplier(4, **kwargs) == pytest.approx(1.0)
    assert lr_multiplier(9, **kwargs) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lr_multiplier(14, **kwargs) == pytest.approx(0.1)
