"""STARE in TRL (stare_lightning/integrations/trl.py) against this project's own step path: TRL's GRPO loop on the
tiny model with fixed completions and rewards, and at every step the weights, loss and gradient this project's
scoring pass, gate, selection and ``micro_batch_loss`` give on the same batch and parameters, with the gate opening
and closing; the controller's state through a checkpoint and a resume; the TRL settings it refuses; nothing of TRL
imported by ``import stare_lightning``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from tests.trl_harness import SETTINGS, STEPS, Dataset, GRPOConfig, project_replay, trainer_for, weights_of

# isort: split
# (the harness first: it skips without TRL and keeps TRL's import from changing vLLM's logging)
from stare_lightning.integrations.trl import (
    STATE_FILE,
    WEIGHTS_KEY,
    STAREGRPOTrainer,
    STARESettings,
    check_grpo_config,
)

RANDOM = {"selector": "random"}


def test_weights_loss_and_gradients_equal_the_projects_over_steps(tiny_dir, tmp_path):
    trainer, gradients = trainer_for(tiny_dir, tmp_path, SETTINGS)
    trainer.train()
    theirs = project_replay(tiny_dir, trainer, SETTINGS)
    assert [b.get(WEIGHTS_KEY) is not None for b in trainer.batches] == [True, False, True, False]
    assert len(gradients.steps) == STEPS
    for step, (batch, want) in enumerate(zip(trainer.batches, theirs)):
        weights = weights_of(batch)
        assert want.params.gate_on == (step % 2 == 0)
        assert torch.equal(weights, want.omega) and bool((weights != 1).any()) == want.params.gate_on
        torch.testing.assert_close(trainer.losses[step], want.loss, atol=2e-6, rtol=1e-5)
        for name, grad in want.grads.items():
            torch.testing.assert_close(
                gradients.steps[step][name], grad, atol=2e-6, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}"
            )
    # The adaptive schedule moved W (applied from the step after each measurement), and the logs carry its names.
    assert [t.params.w for t in theirs] == pytest.approx([1.3, 1.35, 1.3, 1.35])
    logged = {k for row in trainer.state.log_history for k in row}
    assert {"stare/gate_on", "stare/w", "stare/selected_frac/pos", "quadrant/exact/pos_high/dH"} <= logged


def test_the_comparison_sees_the_weights(tiny_dir, tmp_path):
    """Control: the project's loss with STARE's weights differs from TRL's without them (gate kept shut)."""
    trainer, _ = trainer_for(tiny_dir, tmp_path, {**SETTINGS, "target_entropy": 0.0}, steps=1, place_targets=False)
    trainer.train()
    want = project_replay(tiny_dir, trainer, {**SETTINGS, "target_entropy": 100.0})[0]
    assert want.params.gate_on and WEIGHTS_KEY not in trainer.batches[0]
    assert not torch.allclose(trainer.losses[0], want.loss, atol=1e-5)


def test_a_resumed_run_continues_the_controller(tiny_dir, tmp_path):
    straight, _ = trainer_for(tiny_dir, tmp_path / "straight", SETTINGS, steps=3)
    straight.train()
    first, _ = trainer_for(tiny_dir, tmp_path / "run", SETTINGS, steps=2, save_strategy="steps", save_steps=2)
    # The Hub push of a checkpoint (its last act) sees STARE's state already written; the push itself is recorded.
    pushed = []
    first.args.push_to_hub = True
    first._push_from_checkpoint = lambda folder: pushed.append(sorted(os.listdir(folder)))
    first.train()
    checkpoint = tmp_path / "run" / "checkpoint-2"
    assert len(pushed) == 1 and STATE_FILE in pushed[0] and "trainer_state.json" in pushed[0]
    assert json.loads((checkpoint / STATE_FILE).read_text()) == first.stare.state_dict()
    resumed, _ = trainer_for(tiny_dir, tmp_path / "run", SETTINGS, steps=3)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert resumed.stare.controller.num_updates == 3
    assert (resumed.stare.w, resumed.stare.m) == (straight.stare.w, straight.stare.m) != (1.3, 0.8)
    (checkpoint / STATE_FILE).unlink()
    again, _ = trainer_for(tiny_dir, tmp_path / "run", SETTINGS, steps=3)
    with pytest.raises(ValueError, match=STATE_FILE):
        again.train(resume_from_checkpoint=str(checkpoint))


REFUSED = [  # (config, settings, message, an accepted neighbour: (config, settings))
    ({"num_iterations": 2}, {}, "several optimizer steps per generation batch", ({"num_iterations": 2}, RANDOM)),
    ({"steps_per_generation": 4}, {}, "several optimizer steps", ({"steps_per_generation": 4}, RANDOM)),
    ({"steps_per_generation": 1}, RANDOM, "move 2 times per optimizer step", ({"steps_per_generation": 2}, RANDOM)),
    ({"steps_per_generation": 3}, RANDOM, "not a whole number", ({"steps_per_generation": 4}, RANDOM)),
    ({}, {"scope": "micro_batch"}, "random split", ({}, {"scope": "sequence"})),
    ({"loss_type": "sapo"}, {}, "loss_type='sapo' is refused", ({"loss_type": "dapo"}, {})),
    *[
        (
            {"importance_sampling_level": "sequence", "loss_type": loss},
            {},
            "the row's mean omega",
            ({"importance_sampling_level": "sequence", "loss_type": "cispo"}, {}),
        )
        for loss in ("grpo", "bnpo", "dr_grpo", "dapo")
    ],
    ({"top_entropy_quantile": 0.5}, {}, "top_entropy_quantile=0.5 is refused", ({"top_entropy_quantile": 1.0}, {})),
]


@pytest.mark.parametrize(("config", "settings", "message", "neighbour"), REFUSED)
def test_settings_it_cannot_honour_are_refused(tmp_path, config, settings, message, neighbour):
    base = dict(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none", per_device_train_batch_size=4,
                num_generations=4, gradient_accumulation_steps=2)  # fmt: skip
    with pytest.raises(ValueError, match=message):
        check_grpo_config(GRPOConfig(**{**base, **config}), STARESettings(**settings))
    check_grpo_config(GRPOConfig(**base), STARESettings())  # control: the same base is accepted
    check_grpo_config(GRPOConfig(**{**base, **neighbour[0]}), STARESettings(**neighbour[1]))  # and its neighbour


def test_images_are_refused_at_construction(tiny_dir, tmp_path):
    """Refused before the model loads (a model path that does not exist is never read); control: the same call
    without the image column gets as far as loading the model."""
    args = GRPOConfig(
        output_dir=str(tmp_path),
        use_cpu=True,
        bf16=False,
        report_to="none",
        per_device_train_batch_size=4,
        num_generations=4,
    )
    with_images = Dataset.from_list([{"prompt": "a", "image": None}] * 4)
    with pytest.raises(ValueError, match="does not take images .*'image'"):
        STAREGRPOTrainer(model=str(tmp_path / "absent"), reward_funcs=len, args=args, train_dataset=with_images)
    with pytest.raises(OSError):
        text_only = with_images.remove_columns("image")
        STAREGRPOTrainer(model=str(tmp_path / "absent"), reward_funcs=len, args=args, train_dataset=text_only)


def test_scope_group_needs_whole_groups_on_each_process():
    """With several processes TRL checks the global batch only: a process's 6 rows may cut a group of 4."""
    config = SimpleNamespace(num_iterations=1, steps_per_generation=2, gradient_accumulation_steps=2,
                             per_device_train_batch_size=3, num_generations=4, loss_type="dapo")  # fmt: skip
    with pytest.raises(ValueError, match="whole groups"):
        check_grpo_config(config, STARESettings(scope="group"))
    check_grpo_config(config, STARESettings(scope="sequence"))


def test_import_stare_lightning_imports_no_trl():
    code = (
        "import sys, stare_lightning, stare_lightning.integrations, stare_lightning.integrations.pytorch\n"
        "print('trl' in sys.modules)\n"
        # Control, in the same interpreter: the TRL trainer's module does import it.
        "import stare_lightning.integrations.trl\n"
        "print('trl' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split()[-2:] == ["False", "True"], out


def test_a_head_the_scoring_pass_cannot_form_is_refused(tiny_dir):
    """The scoring pass forms the logits from the head's weight alone: a bias or logits capped after the head are
    refused; control: the tiny model's plain head is accepted."""
    from transformers import AutoModelForCausalLM

    from stare_lightning.integrations.trl_scoring import check_plain_head

    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    check_plain_head(model)
    model.config.final_logit_softcapping = 30.0
    with pytest.raises(ValueError, match="final_logit_softcapping=30.0"):
        check_plain_head(model)
    model.config.final_logit_softcapping = None
    head = model.get_output_embeddings()
    model.set_output_embeddings(torch.nn.Linear(head.in_features, head.out_features, bias=True))
    with pytest.raises(ValueError, match="bias-free linear LM head"):
        check_plain_head(model)
