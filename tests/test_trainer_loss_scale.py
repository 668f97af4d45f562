"""fp16's dynamic loss scale: torch.amp.GradScaler's schedule, exact unscaling, skipped overflows, checkpointed
state, and where fp16 is refused."""

from __future__ import annotations

import math

import pytest
import torch

from stare_lightning.trainer.loss_scale import DynamicLossScale, loss_scale_for
from stare_lightning.trainer.optim import OptimizerSteps, clip_and_step
from stare_lightning.trainer.strategies import FSDP2Strategy
from tests.test_config import CONF, compose_run


def _linear(seed: int = 0) -> torch.nn.Linear:
    torch.manual_seed(seed)
    return torch.nn.Linear(4, 3)


def _sgd(model):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)


def test_the_schedule_is_grad_scalers():
    """Against torch.amp.GradScaler on the same overflow pattern: the same scale after every step."""
    overflows = [True, False, False, False, True, False, False, False, False, False, False, False, True, False]
    ours = DynamicLossScale(growth_interval=3)
    model = _linear()
    optimizer, _ = _sgd(model)
    reference = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=3)
    for overflow in overflows:
        for p in model.parameters():
            p.grad = torch.full_like(p, math.inf if overflow else 1.0)
        reference.scale(torch.ones(()))  # GradScaler sets its scale up at the first scale() call
        reference.unscale_(optimizer)
        reference.step(optimizer)
        reference.update()
        ours.update(finite=not overflow)
        assert ours.scale == reference.get_scale()


def test_unscaled_step_equals_the_unscaled_run_and_an_overflow_is_skipped():
    x, y = torch.randn(8, 4), torch.randn(8, 3)
    plain, scaled = _linear(), _linear()
    scale = DynamicLossScale(scale=1024.0)
    norms = []
    for model, backward, loss_scale in (
        (plain, torch.Tensor.backward, None),
        (scaled, scale.scaled(torch.Tensor.backward), scale),
    ):
        optimizer, scheduler = _sgd(model)
        backward(torch.nn.functional.mse_loss(model(x), y))
        norms.append(clip_and_step(optimizer, scheduler, model, grad_clip=0.5, finite=True, loss_scale=loss_scale))
    assert norms[1] == pytest.approx(norms[0], rel=1e-6)
    for a, b in zip(plain.parameters(), scaled.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert scale.scale == 1024.0 and scale.steps_since_overflow == 1

    before = [p.detach().clone() for p in scaled.parameters()]
    optimizer, scheduler = _sgd(scaled)
    for p in scaled.parameters():
        p.grad = torch.full_like(p, math.inf)
    assert clip_and_step(optimizer, scheduler, scaled, grad_clip=0.5, finite=True, loss_scale=scale) is None
    assert all(torch.equal(a, b) for a, b in zip(before, scaled.parameters()))
    assert scale.scale == 512.0 and scale.steps_since_overflow == 0


def test_in_fp16_small_gradients_survive_only_with_the_loss_scale():
    """The reason for the scale: an fp16 backward of a small loss flushes gradients to zero; scaled, they match fp32."""
    torch.manual_seed(0)
    weight32 = torch.randn(16, 16) * 0.1
    x = torch.randn(32, 16)

    def grad(dtype, scale):
        w = weight32.to(dtype).clone().requires_grad_()
        # The loss in fp32, as the step computes it; its gradients, about 1e-8, are under fp16's smallest subnormal.
        loss = (x.to(dtype) @ w).float().sum() * 1e-9
        (loss * scale).backward()
        return w.grad.float() / scale

    exact = grad(torch.float32, 1.0)
    assert (grad(torch.float16, 1.0) == 0).float().mean() > 0.5
    torch.testing.assert_close(grad(torch.float16, DynamicLossScale().scale), exact, rtol=5e-3, atol=1e-12)


def test_optimizer_steps_state_round_trips_with_its_loss_scale():
    steps = OptimizerSteps(grad_clip=1.0, loss_scale=DynamicLossScale())
    model = _linear()
    optimizer, scheduler = _sgd(model)
    for p in model.parameters():
        p.grad = torch.full_like(p, math.nan)
    with pytest.warns(RuntimeWarning, match=r"step 7.*1 so far.*loss scale now 32768"):
        steps(optimizer, scheduler, model, finite=True, device=None, step=7)
    restored = OptimizerSteps(grad_clip=1.0, loss_scale=DynamicLossScale())
    restored.load_state_dict(steps.state_dict())
    assert restored == steps and restored.loss_scale.scale == 2.0**15
    assert restored.metrics() == {"train/nonfinite_skipped": 1.0, "train/loss_scale": 2.0**15}
    fp32 = OptimizerSteps(grad_clip=1.0)
    fp32.load_state_dict(steps.state_dict())  # an fp16 checkpoint resumed in fp32 keeps the count, needs no scale
    assert fp32.skipped == 1 and fp32.loss_scale is None and "train/loss_scale" not in fp32.metrics()


@pytest.mark.parametrize("param_dtype, scaled", [("float16", True), ("bfloat16", False), (None, False)])
def test_only_fp16_compute_gets_a_loss_scale(param_dtype, scaled):
    assert (loss_scale_for(FSDP2Strategy(param_dtype=param_dtype)) is not None) is scaled
    assert loss_scale_for(object()) is None  # a strategy without FSDP2's mixed precision: fp32 or bf16 autocast


def test_fp16_on_a_cpu_device_is_refused_before_any_process_group():
    strategy = FSDP2Strategy(param_dtype="float16")
    strategy.parallel_devices = [torch.device("cpu")]  # what trainer.accelerator=auto resolves to without a GPU
    with pytest.raises(ValueError, match="param_dtype=float16 needs CUDA devices"):
        strategy.setup_environment()


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["trainer.precision=16-mixed"], "trainer.precision=16-mixed is not supported.*trainer=fsdp_fp16"),
        (["trainer=fsdp_fp16", "trainer.accelerator=cpu"], "param_dtype=float16 needs GPUs"),
    ],
)
def test_fp16_is_refused_where_it_cannot_run(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        compose_run(tmp_path, overrides)


@pytest.mark.parametrize("recipe", sorted(p.stem for p in (CONF / "experiment").glob("paper_*.yaml")))
def test_every_paper_recipe_has_its_fp16_variant(tmp_path, recipe):
    _, run = compose_run(tmp_path, [f"experiment={recipe}", "data.train_files=[/x.parquet]", "trainer=fsdp_fp16"])
    assert run.trainer["strategy"]["param_dtype"] == "float16" and run.trainer["accelerator"] == "gpu"
    assert run.trainer["precision"] == "32-true"  # no autocast on top of FSDP2's own mixed precision
