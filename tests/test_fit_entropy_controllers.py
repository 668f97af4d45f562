"""STARE's target schedule and the PI controller in real fits: what they log each step is their formula applied to
the entropy the run measured, the loss applies the PI weights it logs, and the PI integral survives a resume."""

from __future__ import annotations

import pytest
import torch

from stare_lightning.algorithms.stare_controller import scheduled_target
from stare_lightning.trainer.frozen_base import RUN_STATE
from tests.test_algorithms_entropy_controllers import reference_pi
from tests.test_fit import compose_run, read_metrics, train_rows

pytestmark = pytest.mark.slow

COMMON = ["trainer.val_check_interval=100", "validation.before_fit=false"]


def test_linear_target_schedule_trains_and_logs_its_target(tmp_path, model_cache):
    """Target linear from 5 nats to 0 over 2 steps: 5, 2.5, then 0 held. The tiny model's entropy lies between, so
    the gate is open on the first two steps and closed after (the strict gate never opens at a target of 0)."""
    from stare_lightning import train

    schedule = ["algorithm.stare.target_entropy=5.0", "algorithm.stare.target_schedule=linear"]
    schedule += ["algorithm.stare.target_end=0.0", "algorithm.stare.target_horizon=2"]
    cfg = compose_run(tmp_path, ["trainer.max_steps=4", *COMMON, *schedule])
    train.fit(cfg)
    steps = train_rows(read_metrics(tmp_path))
    assert sorted(steps) == [0, 1, 2, 3]
    for step, row in steps.items():
        want = scheduled_target("linear", 5.0, 0.0, 2, step)
        assert row["train/stare/target"] == pytest.approx(want, abs=1e-6)
        assert row["train/stare/target"] == pytest.approx([5.0, 2.5, 0.0, 0.0][step], abs=1e-6)
        assert row["train/stare/gate_on"] == float(row["train/entropy"] < want)
    assert [steps[s]["train/stare/gate_on"] for s in range(4)] == [1.0, 1.0, 0.0, 0.0]


def test_pi_controller_trains_applies_its_weights_and_resumes(tmp_path, monkeypatch, model_cache):
    """Two steps, then a resume from the checkpoint for two more: every step's logged signal, error and integral are
    the PI law run over the logged entropies of all four steps (so the integral continued across the resume), and
    every micro-batch's loss weighted its tokens by the step's logged weights."""
    from stare_lightning import train
    from stare_lightning.step import loss as loss_module

    applied: list[tuple] = []
    original = loss_module.micro_batch_token_weights

    def observed(mismatch, **kwargs):
        weights = original(mismatch, **kwargs)
        applied.append((kwargs["signs"], kwargs["advantages"], kwargs["mask"], weights))
        return weights

    monkeypatch.setattr(loss_module, "micro_batch_token_weights", observed)
    gains = ["algorithm.entropy_control.pi.kp=2.0", "algorithm.entropy_control.pi.ki=0.5"]
    gains += ["algorithm.entropy_control.pi.target=0.6", "algorithm.entropy_control.pi.integral_limit=0.5"]
    overrides = ["algorithm=entropic_pi", *COMMON, *gains]
    train.fit(compose_run(tmp_path, ["trainer.max_steps=2", *overrides]))
    checkpoint = torch.load(tmp_path / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    saved = checkpoint[RUN_STATE]["entropy_pi"]
    train.fit(compose_run(tmp_path, ["trainer.max_steps=4", "ckpt_path=last", *overrides]))

    steps = train_rows(read_metrics(tmp_path))
    assert sorted(steps) == [0, 1, 2, 3]
    entropies = [steps[s]["train/entropy"] for s in range(4)]
    signals = reference_pi(entropies, 0.6, 2.0, 0.5, 0.5, 0.5)
    integral = 0.0
    for step, row in steps.items():
        error = 0.6 - entropies[step]
        integral = max(-0.5, min(0.5, integral + error))
        assert row["train/pi/error"] == pytest.approx(error, abs=1e-5)
        assert row["train/pi/integral"] == pytest.approx(integral, abs=1e-5)
        assert row["train/pi/signal"] == pytest.approx(signals[step], abs=1e-5)
        assert row["train/pi/weight_pos"] == pytest.approx(1 - signals[step], abs=1e-5)
        assert row["train/pi/weight_neg"] == pytest.approx(1 + signals[step], abs=1e-5)
        if step == 1:
            assert saved["integral"] == pytest.approx(integral, abs=1e-6)  # what the resume started from
    assert any(abs(s) > 1e-3 for s in signals)  # the weights did move off 1
    # The loss applied the logged weights: A > 0 tokens at 1 - u, A < 0 at 1 + u, A = 0 at 1 (STARE off).
    logged = {round(1 - s, 5) for s in signals}
    assert applied and {round(signs.positive, 5) for signs, *_ in applied} <= logged
    for signs, advantages, mask, weights in applied:
        adv = advantages.reshape(-1, 1).expand_as(mask)
        want = torch.where(adv > 0, signs.positive, torch.where(adv < 0, signs.negative, 1.0))
        torch.testing.assert_close(weights[mask], want[mask].to(weights.dtype))
