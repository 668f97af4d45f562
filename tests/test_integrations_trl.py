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

from tests.needs import require

require("trl", "datasets")

# TRL's import sets VLLM_LOGGING_LEVEL=ERROR in this process's environment when vLLM is installed; put it back, so
# that the other tests of this worker (and the processes they start) see vLLM's logging as a run would.
_VLLM_LOGGING_LEVEL = os.environ.get("VLLM_LOGGING_LEVEL")
from datasets import Dataset  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback  # noqa: E402
from trl import GRPOConfig  # noqa: E402

if _VLLM_LOGGING_LEVEL is None:
    os.environ.pop("VLLM_LOGGING_LEVEL", None)
else:
    os.environ["VLLM_LOGGING_LEVEL"] = _VLLM_LOGGING_LEVEL

from stare_lightning.integrations.trl import (  # noqa: E402
    STATE_FILE,
    WEIGHTS_KEY,
    STAREGRPOTrainer,
    STARESettings,
    check_grpo_config,
)
from tests.experiences import on_policy_experience  # noqa: E402
from tests.project_stare import ProjectSTARE, project_algorithm  # noqa: E402

G, PROMPTS_PER_STEP, STEPS, PROMPT_LENGTH, TEMPERATURE = 4, 2, 4, 6, 0.9
SETTINGS = dict(variant="C2", top_ratio=0.2, w=1.3, m=0.8, adaptive=True, alpha=0.05)


def fixed_rollouts(vocab: int, seed: int = 11):
    """Per step: the prompts' token ids (all PROMPT_LENGTH long: no left padding), the completions (3 to 20 tokens,
    no end-of-sequence token) and the rewards (both signs within each group)."""
    g = torch.Generator().manual_seed(seed)
    steps = []
    for _ in range(STEPS):
        prompts = [torch.randint(4, vocab, (PROMPT_LENGTH,), generator=g).tolist() for _ in range(PROMPTS_PER_STEP)]
        lengths = torch.randint(3, 21, (PROMPTS_PER_STEP * G,), generator=g).tolist()
        completions = [torch.randint(4, vocab, (n,), generator=g).tolist() for n in lengths]
        rewards = [float(r) for r in torch.randint(0, 3, (PROMPTS_PER_STEP * G,), generator=g)]
        for group in range(PROMPTS_PER_STEP):  # no group without a spread
            rewards[group * G], rewards[group * G + 1] = 0.0, 2.0
        steps.append(([p for p in prompts for _ in range(G)], completions, rewards))
    return steps


class Recording(STAREGRPOTrainer):
    """Records each step's batch (rows in generation order, with the weights when the gate is open), the parameters
    it was scored with and the loss; places the gate's target just above (even steps) or below (odd) the step's
    entropy, so the gate opens and closes."""

    def __init__(self, *args, place_targets: bool = True, **kwargs):
        super().__init__(*args, **kwargs)
        self.place_targets = place_targets
        self.batches, self.params, self.losses, self.targets = [], [], [], []

    def _stare_scores(self, batch):
        logprobs, entropy, phi = super()._stare_scores(batch)
        if not self.place_targets:
            return logprobs, entropy, phi
        mask = batch["completion_mask"].bool()
        target = float(entropy[mask].double().mean()) + (0.05 if len(self.targets) % 2 == 0 else -0.05)
        self.stare.controller.target_entropy = target
        self.targets.append(target)
        return logprobs, entropy, phi

    def _generate_and_score_completions(self, inputs):
        self.params.append({k: v.detach().clone() for k, v in self.model.state_dict().items()})
        batch = super()._generate_and_score_completions(inputs)
        self.batches.append({k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in batch.items()})
        self.losses.append(torch.zeros(()))
        return batch

    def _compute_loss(self, model, inputs):
        loss = super()._compute_loss(model, inputs)
        self.losses[-1] = self.losses[-1] + loss.detach()
        return loss


class Gradients(TrainerCallback):
    """Each optimizer step's accumulated gradients (no clipping: max_grad_norm=0)."""

    def __init__(self):
        self.steps = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.steps.append({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})


def trainer_for(tiny_dir, out_dir, settings: dict, *, steps: int = STEPS, place_targets: bool = True, **config):
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    rollouts = fixed_rollouts(model.config.vocab_size)
    calls = {"rollout": 0, "reward": 0}

    def rollout(prompts, trainer):
        prompt_ids, completions, _ = rollouts[calls["rollout"] % STEPS]
        calls["rollout"] += 1
        return {"prompt_ids": prompt_ids, "completion_ids": completions, "logprobs": None}

    def reward(completions, **kwargs):
        rewards = rollouts[calls["reward"] % STEPS][2]
        calls["reward"] += 1
        return rewards

    options = dict(
        output_dir=str(out_dir), max_steps=steps, learning_rate=3e-3, per_device_train_batch_size=G,
        gradient_accumulation_steps=PROMPTS_PER_STEP, num_generations=G, max_completion_length=20,
        temperature=TEMPERATURE, loss_type="dapo", beta=0.0, epsilon=0.2, epsilon_high=0.28, max_grad_norm=0.0,
        use_cpu=True, bf16=False, logging_steps=1, report_to="none", save_strategy="no", shuffle_dataset=False, seed=0,
    )  # fmt: skip
    options.update(config)
    dataset = Dataset.from_list([{"prompt": f"question {i}"} for i in range(64)])
    gradients = Gradients()
    trainer = Recording(
        model=model, reward_funcs=reward, args=GRPOConfig(**options), train_dataset=dataset,
        processing_class=tokenizer, rollout_func=rollout, callbacks=[gradients], stare=STARESettings(**settings),
        place_targets=place_targets,
    )  # fmt: skip
    return trainer, gradients


def project_replay(tiny_dir, trainer: Recording, settings: dict):
    """This project's step on each recorded batch, from the parameters TRL scored it with."""
    policy = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    project = ProjectSTARE(project_algorithm(**settings), group_size=G, temperature=TEMPERATURE)
    out = []
    targets = trainer.targets or [project.gate.controller.target_entropy] * len(trainer.batches)
    for batch, params, target in zip(trainer.batches, trainer.params, targets):
        policy.load_state_dict(params)
        mask = batch["completion_mask"].bool()
        prompts = batch["prompt_ids"].tolist()
        responses = [row[mask[i]].tolist() for i, row in enumerate(batch["completion_ids"])]
        experience = on_policy_experience(prompts, responses, batch["advantages"].float(), n=G)
        project.gate.controller.target_entropy = target
        out.append(project.step(policy, experience))
    return out


def test_weights_loss_and_gradients_equal_the_projects_over_steps(tiny_dir, tmp_path):
    trainer, gradients = trainer_for(tiny_dir, tmp_path, SETTINGS)
    trainer.train()
    theirs = project_replay(tiny_dir, trainer, SETTINGS)
    assert [b.get(WEIGHTS_KEY) is not None for b in trainer.batches] == [True, False, True, False]
    assert len(gradients.steps) == STEPS
    for step, (batch, want) in enumerate(zip(trainer.batches, theirs)):
        weights = batch.get(WEIGHTS_KEY, torch.ones_like(batch["completion_mask"], dtype=torch.float32))
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
    first.train()
    checkpoint = tmp_path / "run" / "checkpoint-2"
    assert json.loads((checkpoint / STATE_FILE).read_text()) == first.stare.state_dict()
    resumed, _ = trainer_for(tiny_dir, tmp_path / "run", SETTINGS, steps=3)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert resumed.stare.controller.num_updates == 3
    assert (resumed.stare.w, resumed.stare.m) == (straight.stare.w, straight.stare.m) != (1.3, 0.8)
    (checkpoint / STATE_FILE).unlink()
    again, _ = trainer_for(tiny_dir, tmp_path / "run", SETTINGS, steps=3)
    with pytest.raises(ValueError, match=STATE_FILE):
        again.train(resume_from_checkpoint=str(checkpoint))


@pytest.mark.parametrize(
    ("config", "settings", "message"),
    [
        ({"num_iterations": 2}, {}, "several optimizer steps per generation batch"),
        ({"steps_per_generation": 4}, {}, "several optimizer steps per generation batch"),
        ({}, {"scope": "micro_batch"}, "random split"),
        ({"loss_type": "sapo"}, {}, "loss_type='sapo' is refused"),
    ],
)
def test_settings_it_cannot_honour_are_refused(tmp_path, config, settings, message):
    base = dict(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none", per_device_train_batch_size=4,
                num_generations=4, gradient_accumulation_steps=2)  # fmt: skip
    with pytest.raises(ValueError, match=message):
        check_grpo_config(GRPOConfig(**{**base, **config}), STARESettings(**settings))
    check_grpo_config(GRPOConfig(**base), STARESettings())  # control: the same base is accepted
    # A selector that does not follow the policy may keep one selection for several optimizer steps.
    check_grpo_config(GRPOConfig(**{**base, "num_iterations": 2}), STARESettings(selector="random"))


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
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
    # Control: the TRL trainer's module does import it.
    code_control = code.replace("stare_lightning.integrations.pytorch", "stare_lightning.integrations.trl")
    out = subprocess.run([sys.executable, "-c", code_control], capture_output=True, text=True, check=True).stdout
    assert out.strip().endswith("True")
