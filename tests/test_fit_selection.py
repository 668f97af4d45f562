"""STARE's logged selection is the one the loss applied, in every selection timing, in real fits.

The loss's STARE weights are recorded as they are handed to the loss (an observing wrapper around
``TokenSelection.in_micro_batch``; the computation is untouched); the share of positive-advantage tokens they
weight by W must equal the logged ``train/stare/selected_frac/pos`` of the same step.
"""

from __future__ import annotations

import pytest
import torch

from stare_lightning.step.selection import selection_timing
from tests.test_fit import compose_run, read_metrics, train_rows

pytestmark = pytest.mark.slow

W = 3.0  # O1 weight of a selected positive token: distinct from 1, so omega shows the selection


def test_selection_timing_follows_scope_and_surprisal_source():
    from stare_lightning.algorithms.config import STAREConfig

    expected = {  # (scope, surprisal_source) -> when the applied selection is made (docs/method.md)
        ("step", "current"): "optimizer_step",
        ("group", "current"): "optimizer_step",
        ("sequence", "current"): "micro_batch",
        ("micro_batch", "current"): "micro_batch",
        ("step", "old"): "step",
        ("group", "old"): "step",
        ("sequence", "old"): "step",
        ("micro_batch", "old"): "micro_batch",
    }
    for (scope, source), timing in expected.items():
        assert selection_timing(STAREConfig(enabled=True, scope=scope, surprisal_source=source)) == timing
    assert selection_timing(STAREConfig(enabled=False, scope="micro_batch")) == "step"


def run_and_observe(tmp_path, monkeypatch, overrides, max_steps=2):
    """Run a short fit, recording per optimizer step (global_step) the share of T+ tokens the loss weighted
    by W and, per call, the micro-batch's inputs and applied omega. Returns (module, logged rows, records)."""
    from stare_lightning import train
    from stare_lightning.step.selection import TokenSelection

    records: list[dict] = []
    original = TokenSelection.in_micro_batch
    holder = {}

    def observed(self, part, stats, old_logprobs, params, *, seed):
        omega, selected = original(self, part, stats, old_logprobs, params, seed=seed)
        positive = (part.advantages.reshape(-1, 1) > 0) & part.response_mask
        chosen = (omega == W) & positive if omega is not None else torch.zeros_like(positive)
        current = stats.logprobs.detach()
        inputs = {"advantages": part.advantages, "mask": part.response_mask, "current_logprobs": current}
        records.append(
            {
                "optimizer_step": holder["module"].global_step,
                "chosen": float(chosen.sum()),
                "positive": float(positive.sum()),
                "omega": omega,
                "inputs": inputs,
                "params": params,
            }
        )
        return omega, selected

    monkeypatch.setattr(TokenSelection, "in_micro_batch", observed)
    common = [f"trainer.max_steps={max_steps}", "trainer.val_check_interval=100", "validation.before_fit=false"]
    cfg = compose_run(tmp_path, [*common, f"algorithm.stare.w={W}", "algorithm.stare.target_entropy=100.0", *overrides])
    module, datamodule = train._setup(cfg)
    holder["module"] = module
    train.build_trainer(cfg).fit(module, datamodule=datamodule)
    return module, train_rows(read_metrics(tmp_path)), records


@pytest.mark.parametrize(
    "overrides, timing, optimizer_steps_per_step",
    [
        pytest.param(["algorithm.stare.scope=micro_batch", "forward.micro_batch_tokens=64"], "micro_batch", 1, id="mb"),
        pytest.param(["algorithm.stare.selector=sensitivity"], "optimizer_step", 1, id="sensitivity"),
        pytest.param(
            [
                "algorithm.stare.surprisal_source=old",
                "algorithm.update.ppo_epochs=2",
                "algorithm.update.mini_batches=2",
            ],
            "step",
            4,
            id="old-kept",
        ),
        pytest.param(["algorithm.stare.scope=sequence"], "micro_batch", 1, id="sequence-current"),
        pytest.param(["algorithm=stare_o1_official", "forward.micro_batch_tokens=64"], "micro_batch", 1, id="official"),
        pytest.param(
            ["algorithm.update.ppo_epochs=2", "algorithm.update.mini_batches=2"], "optimizer_step", 4, id="reselect"
        ),
    ],
)
def test_logged_selection_is_the_applied_one(
    tmp_path, model_cache, monkeypatch, overrides, timing, optimizer_steps_per_step
):
    per = optimizer_steps_per_step
    module, steps, records = run_and_observe(tmp_path, monkeypatch, overrides, max_steps=2 * per)
    assert module.plan.selection == timing
    assert len(steps) == 2
    for index, (logged_step, row) in enumerate(sorted(steps.items())):
        assert row["train/stare/gate_on"] == 1.0
        mine = [r for r in records if index * per <= r["optimizer_step"] < (index + 1) * per]
        positive = sum(r["positive"] for r in mine)
        assert positive > 0
        applied = sum(r["chosen"] for r in mine) / positive
        assert row["train/stare/selected_frac/pos"] == pytest.approx(applied, abs=1e-6), logged_step


def test_reselection_ranks_the_current_policy(tmp_path, model_cache, monkeypatch):
    """Scope step with the current log-probs and two PPO epochs over one micro-batch: the second epoch's omega
    is the selection of the policy after the first optimizer step (and, at this learning rate, not the first's)."""
    from tests.test_algorithms_stare import one_part_weights

    overrides = ["algorithm.update.ppo_epochs=2", "optim.lr=0.05", "forward.micro_batch_tokens=100000"]
    _, _, records = run_and_observe(tmp_path, monkeypatch, overrides, max_steps=2)
    first, second = (r for r in records if r["optimizer_step"] < 2)  # one micro-batch per optimizer step
    assert first["omega"] is not None and second["omega"] is not None
    for record in (first, second):
        inputs = record["inputs"]
        expected, _ = one_part_weights(
            inputs["current_logprobs"], inputs["advantages"], inputs["mask"], scope="step", top_ratio=0.1, w=W
        )
        assert torch.equal(record["omega"] == W, expected == W)
    assert not torch.equal(first["omega"], second["omega"])
