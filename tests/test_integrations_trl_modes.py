"""STARE in TRL in each mode it accepts (stare_lightning/integrations/trl.py): the five loss types, left-padded prompts
of different lengths and bf16 against this project's step on the same batches; the controller's updates against the
optimizer steps; and why TRL's sequence-level ratio is refused (the GSPO case with omega [3, 1, 1, 1])."""

from __future__ import annotations

import pytest
import torch

from tests.trl_harness import SETTINGS, Dataset, G, GRPOConfig, project_replay, trainer_for, weights_of

# isort: split
# (the harness first: it skips without TRL and keeps TRL's import from changing vLLM's logging)
from trl import GRPOTrainer

from stare_lightning.algorithms import aggregate_loss
from stare_lightning.algorithms.policy_losses import ClipRange, gspo_surrogate
from stare_lightning.algorithms.surrogates import LossNormalizer
from stare_lightning.integrations.trl import WEIGHTS_KEY, STARESettings, check_grpo_config

# Per loss type, the TRL settings of the comparison: bnpo normalises each micro-batch by its own tokens, so its
# step is one micro-batch; CISPO's epsilon_high is TRL's cap on the ratio (5, not a clip range around 1).
LOSS_CONFIG = {
    "grpo": {},
    "bnpo": {"per_device_train_batch_size": 2 * G, "gradient_accumulation_steps": 1},
    "dr_grpo": {},
    "dapo": {},
    "cispo": {"epsilon_high": 5.0},
}


def assert_equal_to_the_project(tiny_dir, trainer, gradients, *, loss_type="dapo", atol=2e-6, rtol=1e-4):
    theirs = project_replay(tiny_dir, trainer, SETTINGS, loss_type=loss_type)
    assert len(gradients.steps) == len(theirs)
    for step, (batch, want) in enumerate(zip(trainer.batches, theirs)):
        assert want.params.gate_on == (step % 2 == 0)
        weights = weights_of(batch)
        assert torch.equal(weights, want.omega) and bool((weights != 1).any()) == want.params.gate_on
        torch.testing.assert_close(trainer.losses[step], want.loss, atol=atol, rtol=rtol)
        for name, grad in want.grads.items():
            torch.testing.assert_close(
                gradients.steps[step][name], grad, atol=atol, rtol=rtol, msg=lambda m, n=name: f"{n}: {m}"
            )


@pytest.mark.parametrize("loss_type", list(LOSS_CONFIG))
def test_each_loss_type_equals_the_projects(tiny_dir, tmp_path, loss_type):
    """Two steps (gate open, then closed) under ``loss_type`` against the project's counterpart (trl_harness)."""
    trainer, gradients = trainer_for(
        tiny_dir, tmp_path, SETTINGS, steps=2, loss_type=loss_type, **LOSS_CONFIG[loss_type]
    )
    trainer.train()
    assert [b.get(WEIGHTS_KEY) is not None for b in trainer.batches] == [True, False]
    assert_equal_to_the_project(tiny_dir, trainer, gradients, loss_type=loss_type)


def test_left_padded_prompts_of_different_lengths(tiny_dir, tmp_path):
    """TRL passes no position ids, so a left-padded row's positions are shifted by its padding; the tiny model's
    rotary attention depends on relative positions only, so the project's step (positions from the mask) agrees to
    float rounding (1e-5)."""
    trainer, gradients = trainer_for(tiny_dir, tmp_path, SETTINGS, steps=2, ragged=True)
    trainer.train()
    pads = [int((b["prompt_mask"] == 0).sum(1).max()) for b in trainer.batches]
    assert min(pads) > 0  # both steps hold left-padded rows
    assert_equal_to_the_project(tiny_dir, trainer, gradients, atol=1e-5, rtol=1e-4)


def test_bf16_against_the_projects_float32(tiny_dir, tmp_path):
    """TRL's default bf16 autocast against the project's float32 step. Stated tolerances: the scoring pass's
    log-probs within 0.02 of the project's (measured: 0.005), at most one selected token in ten swapped for another
    (measured: 1 swap of 19), and each parameter's gradient within 10% of the project's in norm (measured: 4.7%
    with that swap, 1% without)."""
    trainer, gradients = trainer_for(tiny_dir, tmp_path, SETTINGS, steps=2, bf16=True)
    trainer.train()
    theirs = project_replay(tiny_dir, trainer, SETTINGS)
    for step, (batch, want) in enumerate(zip(trainer.batches, theirs)):
        mask = batch["completion_mask"].bool()
        assert (trainer.stare.ranked[step] - want.scores.logprobs)[mask].abs().max() < 0.02
        swapped = int(((weights_of(batch) != want.omega) & mask).sum()) / 2  # a swap changes two tokens' weights
        assert swapped <= 0.1 * int((want.omega != 1).sum())
        for name, grad in want.grads.items():
            assert (gradients.steps[step][name] - grad).norm() <= 0.1 * grad.norm(), name


def _decoder_forwards_without_grad(trainer) -> list[int]:
    calls = [0]

    def count(_module, _args, _output):
        calls[0] += not torch.is_grad_enabled()

    trainer.model.get_decoder().register_forward_hook(count)
    return calls


def test_the_controller_moves_once_per_optimizer_step(tiny_dir, tmp_path):
    """One generation batch per optimizer step: as many controller updates as optimizer steps."""
    trainer, gradients = trainer_for(tiny_dir, tmp_path, SETTINGS, steps=4)
    forwards = _decoder_forwards_without_grad(trainer)
    trainer.train()
    assert trainer.stare.controller.num_updates == len(gradients.steps) == trainer.state.global_step == 4
    assert forwards[0] == 4 * 2  # the scoring pass: one no-grad forward per micro-batch of rows


def test_several_optimizer_steps_per_batch_move_it_once_per_batch_and_forward_once(tiny_dir, tmp_path):
    """steps_per_generation = 2 x gradient_accumulation_steps (selector random): a generation batch spans two
    optimizer steps and the controller moves once per batch; TRL's old log-prob pass is the scoring pass (its old
    log-probs are what STARE ranked, and the batch is forwarded once without grad, not twice)."""
    settings = {**SETTINGS, "selector": "random"}
    trainer, gradients = trainer_for(
        tiny_dir, tmp_path, settings, steps=4, gradient_accumulation_steps=1, steps_per_generation=2
    )
    forwards = _decoder_forwards_without_grad(trainer)
    trainer.train()
    assert len(gradients.steps) == 4 and trainer.stare.controller.num_updates == len(trainer.batches) == 2
    for batch, ranked in zip(trainer.batches, trainer.stare.ranked):
        assert torch.equal(batch["old_per_token_logps"], ranked)
    assert forwards[0] == 2 * 2  # two generation batches of two micro-batches each


class LeafLogprobs(GRPOTrainer):
    """TRL's own loss on given log-probs (a leaf tensor), so that its gradient per token can be read."""

    logprobs: torch.Tensor

    def _get_per_token_logps_and_entropies(self, *args, **kwargs):
        return self.logprobs, torch.zeros_like(self.logprobs), None


def _trl_gradient(tiny_dir, tmp_path, omega, **config) -> torch.Tensor:
    """d(loss)/d(log p) of TRL's loss on one on-policy row of len(omega) tokens, advantage 1, with STARE's weights
    applied as STAREGRPOTrainer applies them (the advantages times omega), times the row's token count."""
    options = dict(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none", num_generations=4)
    args = GRPOConfig(**options, per_device_train_batch_size=4, **config)
    dataset = Dataset.from_list([{"prompt": "a"}] * 4)
    trainer = LeafLogprobs(model=str(tiny_dir), reward_funcs=len, args=args, train_dataset=dataset)
    trainer.model.eval()  # no accumulation normaliser: the loss of this one row
    width = len(omega)
    trainer.logprobs = torch.full((1, width), -1.0, requires_grad=True)
    inputs = {
        "prompt_ids": torch.zeros(1, 2, dtype=torch.long),
        "prompt_mask": torch.ones(1, 2, dtype=torch.long),
        "completion_ids": torch.zeros(1, width, dtype=torch.long),
        "completion_mask": torch.ones(1, width, dtype=torch.long),
        "advantages": torch.tensor([omega]),
        "num_items_in_batch": torch.tensor(float(width)),
    }
    trainer._compute_loss(trainer.model, inputs).backward()
    return trainer.logprobs.grad[0] * width


def test_sequence_level_ratio_spreads_omega_and_is_refused(tiny_dir, tmp_path):
    omega = [3.0, 1.0, 1.0, 1.0]
    # This project's GSPO keeps each token's omega: d(loss)/d(log p) = -omega (times the token count).
    logprobs = torch.full((1, 4), -1.0, requires_grad=True)
    mask = torch.ones(1, 4, dtype=torch.bool)
    per_token, _ = gspo_surrogate(
        logprobs, logprobs.detach(), torch.ones(1), mask, ClipRange(0.2, 0.28), token_weights=torch.tensor([omega])
    )
    aggregate_loss(per_token, mask, "seq-mean-token-mean", LossNormalizer(4, 1)).backward()
    assert (logprobs.grad[0] * 4).tolist() == pytest.approx([-3.0, -1.0, -1.0, -1.0])
    # TRL's sequence ratio runs its gradient through the row's mean log-prob: every token gets the mean omega.
    sequence = {"importance_sampling_level": "sequence", "loss_type": "grpo"}
    assert _trl_gradient(tiny_dir, tmp_path, omega, **sequence).tolist() == pytest.approx([-1.5] * 4)
    with pytest.raises(ValueError, match="the row's mean omega"):
        check_grpo_config(GRPOConfig(output_dir=str(tmp_path), use_cpu=True, **sequence), STARESettings())
    # Control: with CISPO the sequence ratio is detached, and each token keeps its omega; accepted.
    cispo = {"importance_sampling_level": "sequence", "loss_type": "cispo", "epsilon_high": 5.0}
    assert _trl_gradient(tiny_dir, tmp_path, omega, **cispo).tolist() == pytest.approx([-3.0, -1.0, -1.0, -1.0])
    check_grpo_config(GRPOConfig(output_dir=str(tmp_path), use_cpu=True, **cispo), STARESettings())
