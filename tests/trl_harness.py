"""TRL's GRPO loop on the tiny model with fixed completions and rewards, recorded, and this project's step replayed on
each recorded batch: what tests/test_integrations_trl*.py compare (stare_lightning/integrations/trl.py)."""

from __future__ import annotations

import os

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

from stare_lightning.integrations.pytorch import STARE  # noqa: E402
from stare_lightning.integrations.trl import STAREGRPOTrainer, STARESettings  # noqa: E402
from tests.experiences import on_policy_experience  # noqa: E402
from tests.project_stare import ProjectSTARE, project_algorithm  # noqa: E402

G, PROMPTS_PER_STEP, STEPS, PROMPT_LENGTH, TEMPERATURE, MAX_COMPLETION = 4, 2, 4, 6, 0.9, 20
SETTINGS = dict(variant="C2", top_ratio=0.2, w=1.3, m=0.8, adaptive=True, alpha=0.05)
# TRL's loss type -> this project's (aggregation, surrogate). bnpo and dapo are both the token mean over the step as
# long as a step is one micro-batch (bnpo normalises each micro-batch by its own tokens).
PROJECT_LOSS = {
    "grpo": ("seq-mean-token-mean", "ppo"),
    "bnpo": ("token-mean", "ppo"),
    "dr_grpo": ("seq-mean-token-sum-norm", "ppo"),
    "dapo": ("token-mean", "ppo"),
    "cispo": ("token-mean", "cispo"),
}


def fixed_rollouts(vocab: int, *, seed: int = 11, ragged_prompts: bool = False):
    """Per step: the prompts' token ids (PROMPT_LENGTH long, or 2 to 9 tokens with ``ragged_prompts``, which TRL
    left-pads), the completions (3 to 20 tokens, no end-of-sequence token) and the rewards (both signs within each
    group)."""
    g = torch.Generator().manual_seed(seed)
    steps = []
    for _ in range(STEPS):
        lengths = torch.randint(2, 10, (PROMPTS_PER_STEP,), generator=g).tolist() if ragged_prompts else None
        prompts = [
            torch.randint(4, vocab, (lengths[i] if lengths else PROMPT_LENGTH,), generator=g).tolist()
            for i in range(PROMPTS_PER_STEP)
        ]
        sizes = torch.randint(3, MAX_COMPLETION + 1, (PROMPTS_PER_STEP * G,), generator=g).tolist()
        completions = [torch.randint(4, vocab, (n,), generator=g).tolist() for n in sizes]
        rewards = [float(r) for r in torch.randint(0, 3, (PROMPTS_PER_STEP * G,), generator=g)]
        for group in range(PROMPTS_PER_STEP):  # no group without a spread
            rewards[group * G], rewards[group * G + 1] = 0.0, 2.0
        steps.append(([p for p in prompts for _ in range(G)], completions, rewards))
    return steps


class TargetPlacing(STARE):
    """STARE whose gate target is placed just above (even steps) or below (odd) each step's entropy, so the gate
    opens and closes; records what each step ranked by."""

    def __init__(self, *args, place_targets: bool, **kwargs):
        super().__init__(*args, **kwargs)
        self.place_targets = place_targets
        self.targets, self.ranked = [], []

    def step(self, advantages, mask, *, logprobs=None, entropy=None, **kwargs):
        self.ranked.append(logprobs.detach().clone())
        if self.place_targets:
            target = float(entropy[mask].double().mean()) + (0.05 if len(self.targets) % 2 == 0 else -0.05)
            self.controller.target_entropy = target
            self.targets.append(target)
        return super().step(advantages, mask, logprobs=logprobs, entropy=entropy, **kwargs)


class Recording(STAREGRPOTrainer):
    """Records each generation batch (rows in generation order, with the weights when the gate is open), the
    parameters it was scored with and the summed loss of its micro-batches."""

    def __init__(self, *args, place_targets: bool = True, **kwargs):
        super().__init__(*args, **kwargs)
        self.stare = TargetPlacing(self.stare.settings, group_size=self.num_generations, place_targets=place_targets)
        self.batches, self.params, self.losses = [], [], []

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


def trainer_for(tiny_dir, out_dir, settings: dict, *, steps=STEPS, place_targets=True, ragged=False, seed=11, **config):
    """A ``Recording`` trainer of ``steps`` optimizer steps on the fixed rollouts (``seed``'s), and its
    ``Gradients``."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    rollouts = fixed_rollouts(model.config.vocab_size, seed=seed, ragged_prompts=ragged)
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
        output_dir=str(out_dir),
        max_steps=steps,
        learning_rate=3e-3,
        per_device_train_batch_size=G,
        gradient_accumulation_steps=PROMPTS_PER_STEP,
        num_generations=G,
        max_completion_length=MAX_COMPLETION,
        temperature=TEMPERATURE,
        loss_type="dapo",
        beta=0.0,
        epsilon=0.2,
        epsilon_high=0.28,
        max_grad_norm=0.0,
        use_cpu=True,
        bf16=False,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        shuffle_dataset=False,
        seed=0,
    )
    options.update(config)
    dataset = Dataset.from_list([{"prompt": f"question {i}"} for i in range(64)])
    gradients = Gradients()
    trainer = Recording(
        model=model,
        reward_funcs=reward,
        args=GRPOConfig(**options),
        train_dataset=dataset,
        processing_class=tokenizer,
        rollout_func=rollout,
        callbacks=[gradients],
        stare=STARESettings(**settings),
        place_targets=place_targets,
    )
    return trainer, gradients


def project_replay(tiny_dir, trainer: Recording, settings: dict, *, loss_type: str = "dapo"):
    """This project's step on each recorded batch, from the parameters TRL scored it with, under the project's
    counterpart of ``loss_type``."""
    targets = trainer.stare.targets or [None] * len(trainer.batches)
    return replay(tiny_dir, trainer.batches, trainer.params, targets, settings, loss_type=loss_type)


def replay(tiny_dir, batches, params, targets, settings: dict, *, loss_type: str = "dapo"):
    """This project's step on each batch (``prompt_ids``, ``prompt_mask``, ``completion_ids``, ``completion_mask``
    and ``advantages`` as TRL holds them) from its parameters, with its gate target (None: the settings')."""
    policy = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    loss_agg, surrogate = PROJECT_LOSS[loss_type]
    project = ProjectSTARE(
        project_algorithm(loss_agg=loss_agg, policy_loss=surrogate, **settings), group_size=G, temperature=TEMPERATURE
    )
    out = []
    for batch, state, target in zip(batches, params, targets):
        policy.load_state_dict(state)
        mask = batch["completion_mask"].bool()
        prompts = [row[batch["prompt_mask"][i].bool()].tolist() for i, row in enumerate(batch["prompt_ids"])]
        responses = [row[mask[i]].tolist() for i, row in enumerate(batch["completion_ids"])]
        experience = on_policy_experience(prompts, responses, batch["advantages"].float(), n=G)
        if target is not None:
            project.gate.controller.target_entropy = target
        out.append(project.step(policy, experience, max_response_length=MAX_COMPLETION))
    return out


def weights_of(batch) -> torch.Tensor:
    """The omega a recorded batch carried (all ones when the gate was closed)."""
    from stare_lightning.integrations.trl import WEIGHTS_KEY

    return batch.get(WEIGHTS_KEY, torch.ones_like(batch["completion_mask"], dtype=torch.float32))
