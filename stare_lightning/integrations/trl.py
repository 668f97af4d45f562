"""STARE in TRL: ``STAREGRPOTrainer``, TRL's ``GRPOTrainer`` with STARE-O1/C2 applied as this project applies it.

What it implements: STARE (Luo et al. 2026, arXiv 2606.19236; docs/method.md, section 3) on TRL's GRPO loop through
a few overrides. After TRL generates and scores a generation batch, a no-grad pass of the policy over it
(``trl_scoring``: eval mode, from the last hidden states, never the full logits) gives each completion token's
log-prob, entropy and entropy sensitivity Phi. Where TRL computes old log-probs itself (several optimizer steps per
generation batch, or vLLM's importance-sampling correction), that pass stands in for TRL's old log-prob pass: the
batch is forwarded once, and TRL's ratio and STARE's ranking read the same log-probs. ``integrations.pytorch.STARE``
then measures the step's batch entropy (the token mean over every process's completion tokens), moves the
controller (gate, adaptive W and M) once per generation batch, which is once per optimizer step or once per several
(never more often: refused), and selects the top-P surprisal tokens of each advantage sign over the whole batch
(scope "step", gathered across processes). The weights travel with the batch's rows through TRL's shuffle and
split. In the loss, each completion token's advantage is multiplied by its omega
before TRL's own per-token loss: since omega > 0 and every loss and ratio this trainer accepts is the advantage
times a factor that depends on the advantage's sign only (the token ratio clipped, also with ``delta``; CISPO's
detached ratio, token or sequence level), that is omega times the per-token loss after clipping, which is this
project's STARE. The off-policy mask reads the advantage's sign only and vLLM's correction multiplies the per-token
loss, so both commute with omega; KL and the entropy bonus stay unweighted, as here. With the gate closed no weight
is attached and TRL's loss runs unchanged. The controller's state is saved in each checkpoint
(``stare_state.json``, written before the checkpoint is pushed) and read back on resume. Metrics go to TRL's logs
under this project's names: ``stare/gate_on``, ``stare/w``, ``stare/m``, ``stare/gate_entropy``,
``stare/selected_frac/pos|neg``, ``quadrant/{proxy,exact}/<quadrant>/{tokens,weight,dH}``.

Refused at construction, with the reason (``trl_checks``): a generation batch that is not a whole number of
optimizer steps; several optimizer steps per batch with a selector that follows the policy; TRL's sequence-level
ratio except with CISPO; TRL's high-entropy mask (``top_entropy_quantile`` < 1); scope "micro_batch"; scope "group"
with groups cut across processes; the loss types without a counterpart here; images; a head this pass cannot form
(bias, scaled or capped logits). TRL versions outside the tested range are refused at import.

Departures from this project's trainer: TRL's training forward passes no position ids (rows with left-padded
prompts see positions shifted by their padding; the scoring pass does the same, so selection and loss agree, and a
rotary model's attention does not depend on the shift); the gate reads the token mean (no
``gate_aggregation=like_loss``); there is no first-order entropy forecast, no same-batch entropy change, no
rollout/trainer log-prob canary and no dynamic sampling.
"""

from __future__ import annotations

import json
import os
from importlib.metadata import version

import torch

from stare_lightning.algorithms.sensitivity import entropy_sensitivity
from stare_lightning.algorithms.token_stats import TokenStats
from stare_lightning.distributed import rank as global_rank
from stare_lightning.integrations.pytorch import STARE, STARESettings
from stare_lightning.integrations.trl_checks import check_grpo_config, check_text_only
from stare_lightning.integrations.trl_scoring import check_plain_head, score_completions
from stare_lightning.seeds import derived_seed

try:
    from trl import GRPOTrainer
    from trl.models.utils import disable_gradient_checkpointing
except ImportError as error:  # pragma: no cover - exercised without the extra installed
    raise ImportError(
        f"stare_lightning.integrations.trl needs TRL: pip install 'stare_lightning[trl]' ({error})"
    ) from None

__all__ = ["STATE_FILE", "TESTED_TRL", "STAREGRPOTrainer", "STARESettings", "check_grpo_config"]

TESTED_TRL = (1, 16)  # the minor release these overrides were read against and tested with (pyproject's [trl] extra)
STATE_FILE = "stare_state.json"
WEIGHTS_KEY = "stare_weights"  # the generation batch's per-token omega (present only while the gate is open)


def _check_version() -> None:
    found = version("trl")
    if tuple(int(part) for part in found.split(".")[:2]) != TESTED_TRL:
        raise ImportError(
            f"stare_lightning.integrations.trl is tested with trl {TESTED_TRL[0]}.{TESTED_TRL[1]}.x, found {found}: "
            "it overrides GRPOTrainer internals that change between releases (pip install 'stare_lightning[trl]')"
        )


_check_version()


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
        datasets = [kwargs.get(name, args[i] if len(args) > i else None) for i, name in _DATASETS]
        check_text_only(*(d for d in datasets if d is not None))
        super().__init__(*args, **kwargs)
        check_grpo_config(self.args, settings)
        check_plain_head(self.model)
        self.stare = STARE(settings, group_size=self.num_generations)
        self._stare_capture = False  # armed while TRL's old log-prob pass is the scoring pass
        self._stare_scores_taken: TokenStats | None = None

    # ------------------------------------------------------------------------------------------ the batch
    def _generate_and_score_completions(self, inputs):
        training = self.model.training
        self._stare_capture, self._stare_scores_taken = training and self._computes_old_logprobs(), None
        try:
            batch = super()._generate_and_score_completions(inputs)
        finally:
            self._stare_capture = False
        if not training:  # evaluation: no STARE, and the controller does not move
            return batch
        if batch.get("pixel_values") is not None:
            raise ValueError("STAREGRPOTrainer does not take images: its scoring pass forwards text only")
        mask = batch["completion_mask"] if "tool_mask" not in batch else batch["completion_mask"] * batch["tool_mask"]
        stats = self._stare_scores_taken if self._stare_scores_taken is not None else self._stare_scores(batch)
        self._stare_scores_taken = None
        phi = entropy_sensitivity(stats.logprobs, stats.entropy, stats.sum_p2, stats.sum_p2_logp)
        seed = derived_seed(self.args.seed + self.state.global_step, global_rank())
        result = self.stare.step(
            batch["advantages"],
            mask.bool(),
            logprobs=stats.logprobs,
            entropy=stats.entropy,
            phi=phi,
            generator=torch.Generator().manual_seed(seed),
        )
        for name, value in result.metrics.items():
            if name != "entropy":  # TRL logs the policy's entropy itself; the gate's reading is stare/gate_entropy
                self._metrics["train"][name].append(value)
        if result.gate_on:
            batch[WEIGHTS_KEY] = result.weights.to(batch["advantages"].device)
        return batch

    def _computes_old_logprobs(self) -> bool:
        """Whether TRL runs its own no-grad pass for old log-probs over this generation batch (its condition)."""
        generate_every = self.args.steps_per_generation * self.num_iterations
        corrected = self.use_vllm and self.vllm_importance_sampling_correction
        return self.args.gradient_accumulation_steps % generate_every != 0 or corrected

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        """TRL's old log-prob pass, when armed, is STARE's scoring pass: one forward gives TRL its old log-probs and
        STARE its statistics (the first no-grad call on the policy; the reference's, if any, comes after)."""
        if not (self._stare_capture and model is self.model and not torch.is_grad_enabled()):
            return super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, *args, **kwargs
            )
        self._stare_capture = False
        self._stare_scores_taken = self._score(input_ids, attention_mask, logits_to_keep)
        return self._stare_scores_taken.logprobs, None, None

    def _stare_scores(self, batch) -> TokenStats:
        """Each completion token's log-prob, entropy (at the sampling temperature) and the sums behind Phi."""
        input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
        attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
        return self._score(input_ids, attention_mask, batch["completion_ids"].size(1))

    def _score(self, input_ids, attention_mask, width: int) -> TokenStats:
        with disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs):
            return score_completions(
                self.model,
                input_ids,
                attention_mask,
                width,
                rows_per_forward=self.args.per_device_train_batch_size,
                temperature=self.temperature,
                autocast=self.accelerator.autocast,
                head_in_fp32=self.args.cast_lm_head_to_fp32,
            )

    # ------------------------------------------------------------------------------------------- the loss
    def _compute_loss(self, model, inputs):
        weights = inputs.get(WEIGHTS_KEY)
        if weights is None:
            return super()._compute_loss(model, inputs)
        advantages = inputs["advantages"]
        advantages = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
        return super()._compute_loss(model, {**inputs, "advantages": advantages * weights.to(advantages.dtype)})

    # ------------------------------------------------------------------------------------ the checkpoints
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """STARE's state first, then TRL's save: TRL pushes (``push_to_hub``) at the end of a save and of a
        checkpoint, so the pushed copy holds the state a resume needs."""
        if self.args.should_save:
            folder = output_dir if output_dir is not None else self.args.output_dir
            os.makedirs(folder, exist_ok=True)
            with open(os.path.join(folder, STATE_FILE), "w") as handle:
                json.dump(self.stare.state_dict(), handle)
        super().save_model(output_dir, _internal_call=_internal_call)

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None:
            return
        path = os.path.join(checkpoint, STATE_FILE)
        if not os.path.isfile(path):
            raise ValueError(f"checkpoint {checkpoint} has no {STATE_FILE}: it was not saved by STAREGRPOTrainer")
        with open(path) as handle:
            self.stare.load_state_dict(json.load(handle))


# GRPOTrainer's dataset arguments: (position, name).
_DATASETS = ((3, "train_dataset"), (4, "eval_dataset"))
