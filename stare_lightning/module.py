"""The training system: policy, optional reference model, rollout engine, STARE controller and telemetry.

The LightningModule only wires parts together; one step reads top to bottom in ``training_step``, with
the work done by ``stare_lightning.step`` (collect, score, loss) and ``stare_lightning.algorithms``.
Rollouts happen inside ``training_step`` (a dataloader would prefetch and make them one update stale);
the optimisation is manual because one rollout batch feeds ``ppo_epochs x mini_batches`` optimizer
steps, each accumulated over token-budget micro-batches.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import asdict, replace

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule
from transformers import AutoModelForCausalLM, AutoTokenizer

from stare_lightning import distributed
from stare_lightning.algorithms import AlgorithmConfig, StepParams, selection_timing, step_selection
from stare_lightning.algorithms.stare_controller import GRPO_PARAMS
from stare_lightning.config.schema import TelemetryConfig, ValidationConfig
from stare_lightning.data.benchmarks import benchmark_sampling
from stare_lightning.evaluation.samples import sample_records
from stare_lightning.metrics.step_timer import StepTimer
from stare_lightning.metrics.telemetry import (
    TrainTelemetry,
    ValidationTelemetry,
    current_memory_gib,
    peak_memory_gib,
)
from stare_lightning.models.config import ModelConfig
from stare_lightning.models.lora import apply_lora
from stare_lightning.models.sharding import shard_model, sharding_policies
from stare_lightning.rewards.majority import majority_correct
from stare_lightning.rewards.pool import VerifierPool
from stare_lightning.rollout.base import SamplingParams, prompt_seeds
from stare_lightning.rollout.canary import LogprobCanary
from stare_lightning.rollout.config import RolloutConfig
from stare_lightning.rollout.episodes import ToolEpisodes
from stare_lightning.rollout.factory import SyncedEngine
from stare_lightning.step import Experience, RolloutBatch, TokenScores, micro_batch_loss, micro_batches
from stare_lightning.step.batch import mini_batch_rows
from stare_lightning.step.collect import collect, verify
from stare_lightning.step.loss import gate_entropy, step_normalizer
from stare_lightning.step.scoring import (
    response_logits,
    same_batch_entropy_change,
    score_batch,
    scores_from_logits,
)
from stare_lightning.tools import Tool, ToolsConfig, build_format
from stare_lightning.trainer.config import OptimConfig
from stare_lightning.trainer.cpu_threads import share_cores
from stare_lightning.trainer.optim import build_optimizer
from stare_lightning.trainer.precision import compute_dtype


class STAREModule(LightningModule):
    def __init__(
        self,
        *,
        model_dir: str,
        model: ModelConfig,
        algorithm: AlgorithmConfig,
        rollout: RolloutConfig,
        optim: OptimConfig,
        validation: ValidationConfig,
        telemetry: TelemetryConfig | None = None,
        val_sampling: Mapping[str, SamplingParams] | None = None,
        seed: int = 0,
        allowed_targets: Sequence[str] = (),
        tools: ToolsConfig | None = None,
        tool: Tool | None = None,
    ) -> None:
        super().__init__()
        self.automatic_optimization = False
        groups = {"model": model, "algorithm": algorithm, "rollout": rollout, "optim": optim}
        self.save_hyperparameters(
            {
                "model_dir": str(model_dir),
                "seed": seed,
                **{k: asdict(v) for k, v in groups.items()},
                "tools": asdict(tools or ToolsConfig()),
            }  # fmt: skip
        )
        self.model_dir, self.seed, self.allowed_targets = str(model_dir), seed, list(allowed_targets)
        self.model_cfg, self.algorithm, self.rollout, self.optim = model, algorithm, rollout, optim
        self.layout = optim.forward_layout()  # padded or packed micro-batches, logits or the fused LM head
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.policy: torch.nn.Module | None = None
        self.reference: torch.nn.Module | None = None
        self.engine = SyncedEngine(rollout, self.tokenizer, self.model_dir, seed=seed)
        # With a tool every rollout is an episode (rollout/episodes.py); the module owns the tool and closes it.
        self.tools, self.tool = tools or ToolsConfig(), tool
        self.call_format = build_format(self.tools.format, tool, self.tokenizer) if tool is not None else None
        self.controller = algorithm.stare.make_controller() if algorithm.stare.enabled else None
        self.selection_timing = selection_timing(algorithm.stare)
        self.entropy_coefficient = algorithm.make_entropy_coefficient()
        self.canary = LogprobCanary(threshold=rollout.canary_threshold, patience=rollout.canary_patience)
        self.verifiers = VerifierPool()
        self.same_batch_entropy = telemetry is not None and telemetry.same_batch_entropy
        self.train_telemetry = TrainTelemetry(
            validation.reflection_words, same_batch=self.same_batch_entropy, tool_use=tool is not None
        )
        # Validation benchmarks -> their sampling; a batch of an unlisted benchmark uses the rollout group's.
        self.val_sampling = dict(val_sampling or {})
        benchmarks = {name: params.n for name, params in self.val_sampling.items()}
        self.val_telemetry = ValidationTelemetry(
            validation.pass_k, validation.reflection_words, benchmarks, tool_use=tool is not None
        )
        self.nonfinite_skipped = 0
        self.last_rollout_samples: list[dict] = []

    @classmethod
    def from_config(
        cls, cfg, model_dir: str, val_benchmarks: Sequence[str] = (), tool: Tool | None = None
    ) -> STAREModule:
        """The module of a validated ``RunConfig``; ``val_benchmarks``: the validation data's benchmarks;
        ``tool``: the tool ``cfg.tools`` names, already built (its sandbox checked before the model loads)."""
        groups = {"model": cfg.model, "algorithm": cfg.algorithm, "rollout": cfg.rollout, "optim": cfg.optim}
        sampling = benchmark_sampling(cfg.rollout, cfg.data.val_sets, val_benchmarks)
        return cls(model_dir=model_dir, validation=cfg.validation, telemetry=cfg.telemetry, val_sampling=sampling,
                   seed=cfg.seed, allowed_targets=cfg.allowed_targets, tools=cfg.tools, tool=tool,
                   **groups)  # fmt: skip

    # ----------------------------------------------------------------------------------------- models
    def setup(self, stage: str) -> None:
        if self.device.type == "cpu":
            share_cores(self.trainer.world_size, self.trainer.num_devices)

    def configure_model(self) -> None:
        if self.policy is not None:  # validate-then-fit calls this twice
            return
        dtype = getattr(torch, self.model_cfg.dtype)
        self.policy = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=dtype)
        if self.model_cfg.gradient_checkpointing:
            self.policy.gradient_checkpointing_enable()
        if self.model_cfg.lora is not None:  # only the adapters train; the engine and exports get merged weights
            self.policy = apply_lora(self.policy, self.model_cfg.lora)
        if self.algorithm.uses_reference():
            self.reference = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=dtype).eval()
            self.reference.requires_grad_(False)
        if self.device_mesh is not None:
            policies = sharding_policies(self.trainer.strategy)  # mixed precision, CPU offload
            for model in (self.policy, self.reference):
                if model is not None:
                    shard_model(model, self.device_mesh, **policies)

    def configure_optimizers(self):
        optimizer, scheduler = build_optimizer(
            self.policy.parameters(), self.optim, total_steps=self.trainer.max_steps, extra_allowed=self.allowed_targets
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def _rollout_engine(self):
        dtype = compute_dtype(self.trainer.strategy, self.trainer.precision, self.policy)
        return self.engine.get(self.policy, dtype)

    def _sampler(self):
        """What rollouts come from: the engine, or tool-using episodes on top of it."""
        engine = self._rollout_engine()
        if self.tool is None:
            return engine
        return ToolEpisodes(engine, self.tool, self.call_format, self.tokenizer,
                            max_turns=self.rollout.episode_turns(), max_workers=self.tools.max_workers)  # fmt: skip

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        self.engine.mark_stale()
        state = checkpoint.get("stare_lightning", {})
        if self.controller is not None and state.get("controller") is not None:
            self.controller.load_state_dict(state["controller"])
        if self.entropy_coefficient is not None and state.get("entropy_coefficient") is not None:
            self.entropy_coefficient.load_state_dict(state["entropy_coefficient"])
        self.nonfinite_skipped = state.get("nonfinite_skipped", 0)

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["stare_lightning"] = {
            "controller": self.controller.state_dict() if self.controller is not None else None,
            "entropy_coefficient": self.entropy_coefficient.state_dict() if self.entropy_coefficient else None,
            "nonfinite_skipped": self.nonfinite_skipped,
        }

    # -------------------------------------------------------------------------------------- training
    def training_step(self, batch: list[dict], batch_idx: int) -> None:
        timer = StepTimer(self.device)
        collection = collect(
            batch, self._sampler(), self.verifiers, self.rollout.training_sampling(), self.algorithm,
            pad_token_id=self.tokenizer.pad_token_id, more_prompts=self._more_prompts, seed=self._step_seed(),
        )  # fmt: skip
        self.engine.sleep()  # with rollout.enable_sleep_mode: the update gets the engine's GPU memory
        rollouts = collection.batch.to(self.device)
        lr = self.lr_schedulers().get_last_lr()[0]
        timer.lap("collect")
        logits_before = self._response_logits(rollouts) if self.same_batch_entropy else None
        timer.lap("telemetry")
        if self.algorithm.needs_scoring_pass():
            scores = self._score(rollouts, logits_before)
            entropy, params = self._gate(scores, rollouts)
            # Timing `micro_batch`: the loss selects inside each micro-batch instead.
            omega, selected = (
                self._select(scores, rollouts, params) if self.selection_timing != "micro_batch" else (None, None)
            )
            experience = Experience.build(
                rollouts, old_logprobs=scores.logprobs, phi=scores.phi, stare_weights=omega, stare_selected=selected
            )
            timer.lap("score")
            self._update(experience, params)
            timer.lap("update")
        else:  # plain on-policy GRPO: the update's first forward gives the rollout policy's statistics
            experience = Experience.build(
                rollouts, old_logprobs=None, phi=None, stare_weights=None, stare_selected=None
            )
            scores = self._update(experience, GRPO_PARAMS)
            timer.lap("update")
            entropy, params = self._gate(scores, rollouts)  # no controller here: telemetry only
            # What STARE would have selected (no loss applied it): the quadrant and selection telemetry.
            omega, selected = self._select(scores, rollouts, params)
            self.train_telemetry.add_selection(rollouts.advantages, rollouts.response_mask, scores.phi, omega, selected)
        if logits_before is not None:
            self._add_entropy_change(rollouts, scores, logits_before)
        canary = self.canary.update(rollouts.rollout_logprobs, scores.logprobs, rollouts.response_mask)
        timer.lap("telemetry")
        self.engine.mark_stale()
        self._rollout_engine()  # weight sync right after the optimizer steps, on every rank
        timer.lap("sync")
        metrics = self.train_telemetry.compute(
            batch=rollouts, stare_params=params, entropy=entropy, collection=collection, lr=lr
        )
        metrics.update({f"train/{key}": value for key, value in canary.items()})
        metrics["train/nonfinite_skipped"] = float(self.nonfinite_skipped)
        timer.lap("telemetry")
        stats = collection.stats
        times = timer.metrics(rollout_seconds=stats.generation_seconds, verify_seconds=stats.verify_seconds,
                              tool_seconds=stats.tool_seconds, tokens=int(rollouts.attention_mask.sum()))  # fmt: skip
        metrics.update({f"train/{key}": value for key, value in times.items()})
        metrics["train/memory/peak_gib"] = peak_memory_gib(self.device)
        metrics["train/memory/current_gib"] = current_memory_gib(self.device)  # after the step: growth shows here
        self.last_rollout_samples = collection.samples()
        self.log_dict(metrics, on_step=True, on_epoch=False, batch_size=len(batch))

    def _gate(self, scores: TokenScores, rollouts: RolloutBatch) -> tuple[float, StepParams]:
        """H_k over all ranks (token mean); then the adaptive entropy coefficient and STARE's controller take
        their step, STARE's on H_k aggregated as ``algorithm.gate_aggregation()`` says."""
        entropy = self.train_telemetry.batch_entropy(scores.entropy, rollouts.response_mask)
        if self.entropy_coefficient is not None:
            self.entropy_coefficient.update(entropy)
        if self.controller is None:
            return entropy, GRPO_PARAMS
        gate_value = entropy
        if self.algorithm.gate_aggregation() != "token-mean":
            gate_value = gate_entropy(
                scores.entropy, rollouts, self.algorithm, max_response_length=self.rollout.max_new_tokens
            )
        return entropy, self.controller.update(gate_value)

    def _select(self, scores: TokenScores, rollouts: RolloutBatch, params: StepParams):
        """STARE's selection over the step's batch: (omega for the loss or None, the selected tokens)."""
        omega, selection = step_selection(
            scores.logprobs, rollouts.advantages, rollouts.response_mask, scores.phi, self.algorithm, params,
            group_size=self.rollout.n,
        )  # fmt: skip
        return omega, selection.selected

    def _reselect(self, experience: Experience, params: StepParams) -> Experience:
        """The step's selection made again by the policy as it is now (timing ``optimizer_step``)."""
        scores = score_batch(self.policy, experience, **self._pass_options())
        omega, selected = self._select(scores, experience, params)
        return replace(experience, stare_weights=omega, stare_selected=selected)

    def _score(self, rollouts: RolloutBatch, logits: list[torch.Tensor] | None) -> TokenScores:
        """The scoring pass: from the logits the same-batch telemetry already holds, else a forward."""
        if logits is not None:
            return scores_from_logits(logits, rollouts, **self._pass_options())
        return score_batch(self.policy, rollouts, **self._pass_options())

    def _pass_options(self) -> dict:
        """How the no-grad passes over the step's batch run: temperature, chunks, micro-batches, layout."""
        optim = self.optim
        return dict(temperature=self.rollout.temperature, chunk_size=optim.logprob_chunk_size,
                    micro_batch_tokens=optim.micro_batch_tokens, layout=self.layout)  # fmt: skip

    def _response_logits(self, rollouts: RolloutBatch) -> list[torch.Tensor]:
        return response_logits(self.policy, rollouts, micro_batch_tokens=self.optim.micro_batch_tokens,
                               layout=self.layout)  # fmt: skip

    def _add_entropy_change(self, rollouts: RolloutBatch, scores: TokenScores, logits_before: list) -> None:
        """The update's entropy change on this step's tokens, realised and first-order (``telemetry``)."""
        realised, first_order = same_batch_entropy_change(self.policy, rollouts, logits_before, **self._pass_options())
        self.train_telemetry.add_entropy_change(
            realised, first_order, rollouts.advantages, rollouts.response_mask, scores.phi
        )

    def _more_prompts(self, count: int, attempt: int) -> list[dict]:
        return self.trainer.datamodule.more_prompts(count, step=self.global_step, attempt=attempt)

    def _step_seed(self) -> int:
        # The same on every rank: rollouts tell prompts apart by record id and mini-batches are split
        # over the global batch, so the seed must not depend on the rank.
        return self.seed * 1_000_003 + self.global_step

    def _update(self, experience: Experience, params: StepParams) -> TokenScores | None:
        """``ppo_epochs x mini_batches`` optimizer steps on ``experience``, each over token-budget micro-batches.

        Returns the first forward's statistics when ``experience`` has no old log-probs (on-policy).
        Ranks with fewer micro-batches (or none in a mini-batch) run a zero-weight filler micro-batch,
        so every rank runs the same forward/backward collectives.
        """
        alg, budget = self.algorithm, self.optim.micro_batch_tokens
        generator = torch.Generator().manual_seed(self._step_seed())
        offset, total_rows = distributed.row_offset(experience.num_rows, self.device)
        filler = next(micro_batches(experience.select(slice(0, 1)), budget, packed=self.layout.packed))
        coef = self.entropy_coefficient.coef if self.entropy_coefficient is not None else alg.entropy_coef
        first_pass, optimizer_steps = [], 0
        for _ in range(alg.ppo_epochs):
            for rows in mini_batch_rows(
                experience.num_rows, alg.mini_batches, generator, offset=offset, total_rows=total_rows
            ):
                if optimizer_steps and self.selection_timing == "optimizer_step" and params.gate_on:
                    experience = self._reselect(experience, params)
                mini = experience.select(rows.to(experience.input_ids.device))
                normalizer = step_normalizer(mini, max_response_length=self.rollout.max_new_tokens, device=self.device)
                parts = list(micro_batches(mini, budget, packed=self.layout.packed))
                steps = int(distributed.all_reduce(torch.tensor(float(len(parts))), dist.ReduceOp.MAX, self.device))
                finite = True
                for index in range(steps):
                    real = index < len(parts)
                    part = parts[index] if real else filler
                    result = micro_batch_loss(
                        self.policy, self.reference, part, normalizer, alg, params=params, entropy_coef=coef,
                        temperature=self.rollout.temperature, chunk_size=self.optim.logprob_chunk_size,
                        layout=self.layout,
                    )  # fmt: skip
                    loss = result.loss
                    if not torch.isfinite(loss):
                        finite = False
                        loss = torch.nan_to_num(loss, nan=0.0, posinf=0.0, neginf=0.0) * 0.0
                    self.manual_backward(loss * (float(real) * self.trainer.world_size))
                    if real:
                        keep = first_pass if experience.old_logprobs is None else None
                        self._record_micro_batch(part, result, loss, keep)
                self._optimizer_step(finite)
                optimizer_steps += 1
        return TokenScores.from_micro_batches(first_pass, experience.response_width) if first_pass else None

    def _record_micro_batch(self, part: Experience, result, loss: torch.Tensor, first_pass: list | None) -> None:
        """Telemetry of one real micro-batch; its token statistics join ``first_pass`` when one is kept."""
        self.train_telemetry.add_micro_batch({**result.sums, "loss": loss.detach()})
        if result.stare_selected is not None:  # the selection this micro-batch's loss applied
            self.train_telemetry.add_selection(
                part.advantages, part.response_mask, part.phi, result.stare_omega, result.stare_selected
            )
        if first_pass is not None:
            first_pass.append(result.token_stats)

    def _optimizer_step(self, finite: bool) -> None:
        """Clip, then step unless any rank saw a non-finite loss or gradient (then skip and warn)."""
        optimizer, scheduler = self.optimizers(), self.lr_schedulers()
        params = [p for p in self.policy.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, self.optim.grad_clip if self.optim.grad_clip > 0 else math.inf)
        grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)  # a DTensor under FSDP2
        if distributed.all_ranks_agree(finite and math.isfinite(grad_norm), self.device):
            optimizer.step()
            self.train_telemetry.add_optimizer_step(grad_norm)
        else:
            self.nonfinite_skipped += 1
            self.train_telemetry.add_optimizer_step(None)
            message = f"non-finite loss or gradient at step {self.global_step}: optimizer step skipped"
            warnings.warn(f"{message} ({self.nonfinite_skipped} so far)", RuntimeWarning, stacklevel=2)
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()

    # ------------------------------------------------------------------------------------ validation
    def validation_step(self, batch: list[dict], batch_idx: int) -> dict:
        """Sample, verify and vote; returns every sample's record (what ``evaluate`` writes to samples.jsonl)."""
        # A batch never mixes benchmarks; it may be empty (a rank one record short), and still takes part.
        benchmark = batch[0]["metadata"].get("data_source") if batch else None
        params = self.val_sampling.get(benchmark) or self.rollout.validation_sampling()
        # Seeded by record id: validation scores do not depend on the number of ranks or the batch size.
        seeds = prompt_seeds(self.seed * 7919, [str(item["id"]) for item in batch], params.n)
        rollouts = self._sampler().generate([item["prompt_ids"] for item in batch], params, seeds=seeds)
        scores = verify(batch, rollouts, self.verifiers).scores
        majority = majority_correct(batch, rollouts.texts, scores, params.n, self.verifiers)
        self.val_telemetry.update(rollouts, scores, benchmark, majority)
        return {"samples": sample_records(batch, rollouts, scores, majority, benchmark)}

    def on_validation_epoch_end(self) -> None:
        self.log_dict(self.val_telemetry.compute(), on_step=False, on_epoch=True, sync_dist=False)
        self.val_telemetry.reset()

    def teardown(self, stage: str) -> None:
        if stage != "fit":  # `fit` validates first and keeps its engine and verifier workers for training
            return
        self.verifiers.close()
        self.engine.close()
        if self.tool is not None:
            self.tool.close()
