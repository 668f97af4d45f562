"""STARE in TRL: ``STAREGRPOTrainer``, TRL's ``GRPOTrainer`` with STARE-O1/C2 applied as this project applies it.

What it implements: STARE (Luo et al. 2026, arXiv 2606.19236; docs/method.md, section 3) on TRL's GRPO loop through
two overrides. After TRL generates and scores a generation batch, a no-grad pass of the policy over it gives each
completion token's log-prob, entropy and entropy sensitivity Phi; ``integrations.pytorch.STARE`` measures the step's
batch entropy (the token mean over every process's completion tokens), moves the controller (gate, adaptive W and
M) and selects the top-P surprisal tokens of each advantage sign over the whole batch (scope "step", gathered
across processes), and the weights travel with the batch's rows through TRL's shuffle and split. In the loss, each
completion token's advantage is multiplied by its omega before TRL's own per-token loss: since omega > 0 and every
loss this trainer accepts is the advantage times a factor that depends on the advantage's sign only (the clipped
ratio, CISPO's clamped ratio), that is omega times the per-token loss after clipping, which is this project's
STARE; KL and the entropy bonus stay unweighted, as here. With the gate closed no weight is attached and TRL's loss
runs unchanged. The controller's state is saved in each checkpoint (``stare_state.json``) and read back on resume.
Metrics go to TRL's logs under this project's names: ``stare/gate_on``, ``stare/w``, ``stare/m``,
``stare/gate_entropy``, ``stare/selected_frac/pos|neg``, ``quadrant/{proxy,exact}/<quadrant>/{tokens,weight,dH}``.

Refused, with the reason (``check_grpo_config``): several optimizer steps per generation batch (``num_iterations``
> 1, or ``steps_per_generation`` other than ``gradient_accumulation_steps``) with a selector that follows the policy
(this project re-ranks by the updated policy before every later optimizer step; this trainer selects once per
batch); scope "micro_batch" (TRL's micro-batches are a random split of the batch); scope "group" when a process's
rows do not hold whole groups; the loss types without a counterpart here (``sapo``, ``vespo``, ``luspo``); images
(the scoring pass forwards text). TRL versions outside the tested range are refused at import: earlier ones route
some losses around ``_compute_loss`` (a Liger loss that would skip the weights).

Departures from this project's trainer: TRL's training forward passes no position ids (rows with left-padded
prompts then see shifted positions; the scoring pass here does the same, so selection and loss agree); the
scoring pass runs in the model's training mode, as TRL's own old log-probs do; the gate reads the token mean
(no ``gate_aggregation=like_loss``); there is no first-order entropy forecast, no same-batch entropy change,
no rollout/trainer log-prob canary and no dynamic sampling.
"""

from __future__ import annotations

import json
import os
from importlib.metadata import version

import torch

from stare_lightning.algorithms.selectors import STARE_SELECTORS
from stare_lightning.algorithms.sensitivity import entropy_sensitivity
from stare_lightning.algorithms.token_stats import token_stats_from_logits
from stare_lightning.distributed import rank as global_rank
from stare_lightning.integrations.pytorch import STARE, STARESettings

try:
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
    from trl import GRPOConfig, GRPOTrainer
except ImportError as error:  # pragma: no cover - exercised without the extra installed
    raise ImportError(
        f"stare_lightning.integrations.trl needs TRL: pip install 'stare_lightning[trl]' ({error})"
    ) from None

__all__ = ["STATE_FILE", "TESTED_TRL", "STAREGRPOTrainer", "STARESettings", "check_grpo_config"]

TESTED_TRL = (1, 16)  # the minor release these overrides were read against and tested with (pyproject's [trl] extra)
STATE_FILE = "stare_state.json"
WEIGHTS_KEY = "stare_weights"  # the generation batch's per-token omega (present only while the gate is open)
# TRL's losses whose per-token term is the advantage times a factor that depends on the advantage's sign only.
ACCEPTED_LOSSES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo")


def _check_version() -> None:
    found = version("trl")
    if tuple(int(part) for part in found.split(".")[:2]) != TESTED_TRL:
        raise ImportError(
            f"stare_lightning.integrations.trl is tested with trl {TESTED_TRL[0]}.{TESTED_TRL[1]}.x, found {found}: "
            "it overrides GRPOTrainer internals that change between releases (pip install 'stare_lightning[trl]')"
        )


_check_version()


def check_grpo_config(config: GRPOConfig, settings: STARESettings) -> None:
    """Refuse the TRL settings under which this trainer would not apply STARE as this project does."""
    several = config.num_iterations > 1 or config.steps_per_generation != config.gradient_accumulation_steps
    if several and STARE_SELECTORS[settings.selector].follows_policy:
        raise ValueError(
            f"num_iterations={config.num_iterations}, steps_per_generation={config.steps_per_generation} and "
            f"gradient_accumulation_steps={config.gradient_accumulation_steps} give several optimizer steps per "
            "generation batch: this project re-ranks STARE's tokens by the updated policy before each, this trainer "
            "selects once per batch; use num_iterations=1 and steps_per_generation=gradient_accumulation_steps"
        )
    if settings.scope == "micro_batch":
        raise ValueError(
            "STARESettings.scope='micro_batch' is refused: TRL's micro-batches are a random split of the generation "
            "batch, so the selection would depend on it; use scope 'step' (the default), 'sequence' or 'group'"
        )
    rows = config.per_device_train_batch_size * config.steps_per_generation
    if settings.scope == "group" and rows % config.num_generations:
        raise ValueError(
            f"STARESettings.scope='group' needs whole groups on each process: per_device_train_batch_size x "
            f"steps_per_generation = {rows} is not a multiple of num_generations={config.num_generations}"
        )
    if config.loss_type not in ACCEPTED_LOSSES:
        raise ValueError(
            f"loss_type={config.loss_type!r} is refused: STARE's weights are checked against this project's losses "
            f"only, whose counterparts in TRL are {list(ACCEPTED_LOSSES)}"
        )


class STAREGRPOTrainer(GRPOTrainer):
    """TRL's ``GRPOTrainer`` with STARE (module docstring). Takes GRPOTrainer's arguments and ``stare``, a
    ``STARESettings`` (default: STARE-O1 with the paper's P, W, M and target entropy). ``self.stare`` holds the
    controller; its state is in every checkpoint TRL saves."""

    def __init__(self, *args, stare: STARESettings | None = None, **kwargs) -> None:
        settings = stare if stare is not None else STARESettings()
        if not isinstance(settings, STARESettings):
            raise ValueError(f"stare={settings!r} must be a STARESettings")
        config = kwargs.get("args", args[2] if len(args) > 2 else None)
        if config is not None:  # refused before the model loads; TRL's default config is accepted
            check_grpo_config(config, settings)
        super().__init__(*args, **kwargs)
        check_grpo_config(self.args, settings)
        self.stare = STARE(settings, group_size=self.num_generations)

    # ------------------------------------------------------------------------------------------ the batch
    def _generate_and_score_completions(self, inputs):
        batch = super()._generate_and_score_completions(inputs)
        if not self.model.training:  # evaluation: no STARE, and the controller does not move
            return batch
        if batch.get("pixel_values") is not None:
            raise ValueError("STAREGRPOTrainer does not take images: its scoring pass forwards text only")
        mask = batch["completion_mask"] if "tool_mask" not in batch else batch["completion_mask"] * batch["tool_mask"]
        logprobs, entropy, phi = self._stare_scores(batch)
        seed = (self.args.seed + self.state.global_step) * 1_000_003 + global_rank()
        result = self.stare.step(
            batch["advantages"], mask.bool(), logprobs=logprobs, entropy=entropy, phi=phi,
            generator=torch.Generator().manual_seed(seed),
        )  # fmt: skip
        for name, value in result.metrics.items():
            if name != "entropy":  # TRL logs the policy's entropy itself; the gate's reading is stare/gate_entropy
                self._metrics["train"][name].append(value)
        if result.gate_on:
            batch[WEIGHTS_KEY] = result.weights.to(batch["advantages"].device)
        return batch

    @torch.no_grad()
    def _stare_scores(self, batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each completion token's log-prob, entropy (at the sampling temperature) and Phi, a micro-batch of rows at
        a time, from the policy's logits as TRL's loss forward sees them."""
        input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
        attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
        width = batch["completion_ids"].size(1)
        parts = []
        step = self.args.per_device_train_batch_size
        for start in range(0, input_ids.size(0), step):
            rows = slice(start, start + step)
            with self.accelerator.autocast():
                logits = self.model(
                    input_ids=input_ids[rows], attention_mask=attention_mask[rows], logits_to_keep=width + 1,
                    use_cache=False,
                ).logits[:, :-1]  # fmt: skip
            parts.append(
                token_stats_from_logits(
                    logits, batch["completion_ids"][rows], temperature=self.temperature, with_sensitivity=True
                )
            )
        logprobs, entropy, sum_p2, sum_p2_logp = (
            torch.cat([getattr(p, name) for p in parts]) for name in ("logprobs", "entropy", "sum_p2", "sum_p2_logp")
        )
        return logprobs, entropy, entropy_sensitivity(logprobs, entropy, sum_p2, sum_p2_logp)

    # ------------------------------------------------------------------------------------------- the loss
    def _compute_loss(self, model, inputs):
        weights = inputs.get(WEIGHTS_KEY)
        if weights is None:
            return super()._compute_loss(model, inputs)
        advantages = inputs["advantages"]
        advantages = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
        return super()._compute_loss(model, {**inputs, "advantages": advantages * weights.to(advantages.dtype)})

    # ------------------------------------------------------------------------------------ the checkpoints
    def _save_checkpoint(self, model, trial):
        super()._save_checkpoint(model, trial)
        if self.args.should_save:
            folder = os.path.join(
                self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
            )
            with open(os.path.join(folder, STATE_FILE), "w") as handle:
                json.dump(self.stare.state_dict(), handle)

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None:
            return
        path = os.path.join(checkpoint, STATE_FILE)
        if not os.path.isfile(path):
            raise ValueError(f"checkpoint {checkpoint} has no {STATE_FILE}: it was not saved by STAREGRPOTrainer")
        with open(path) as handle:
            self.stare.load_state_dict(json.load(handle))
