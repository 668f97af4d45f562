"""The training system: policy, optional reference model, rollout engine, STARE controller and telemetry.

The LightningModule only wires parts together and keeps the state a checkpoint holds; the step itself (collect,
score, gate, select, update) is ``stare_lightning.step.runner.StepRunner``, driven by a ``StepPlan`` resolved once
from the config. Rollouts happen inside ``training_step`` (a dataloader would prefetch them a step stale) or, with
``rollout=server``, in a producer thread at most ``rollout.max_staleness`` versions behind (step/rollout_sources.py);
the optimisation is manual: one rollout batch feeds ``ppo_epochs x mini_batches`` optimizer steps.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path

import torch
from lightning.pytorch import LightningModule
from transformers import AutoTokenizer

from stare_lightning.algorithms import AlgorithmConfig
from stare_lightning.data.benchmarks import benchmark_sampling
from stare_lightning.data.samples import sample_records
from stare_lightning.metrics.config import TelemetryConfig, ValidationConfig
from stare_lightning.metrics.step_timer import StepTimer
from stare_lightning.metrics.telemetry import TrainTelemetry, ValidationTelemetry, step_costs
from stare_lightning.models.config import ModelConfig
from stare_lightning.models.loading import load_policy, load_reference
from stare_lightning.models.reference import ReferencePolicy
from stare_lightning.models.sharding import shard_model, sharding_policies
from stare_lightning.rewards.majority import majority_correct
from stare_lightning.rewards.pool import VerifierPool
from stare_lightning.rollout.base import SamplingParams, prompt_seeds
from stare_lightning.rollout.canary import LogprobCanary
from stare_lightning.rollout.config import RolloutConfig
from stare_lightning.rollout.episodes import ToolEpisodes
from stare_lightning.rollout.factory import SyncedEngine
from stare_lightning.seeds import derived_seed
from stare_lightning.step.collect import verify
from stare_lightning.step.config import ForwardConfig
from stare_lightning.step.plan import StepPlan
from stare_lightning.step.rollout_sources import EngineAccess, RolloutSource, rollout_source
from stare_lightning.step.runner import StepRunner
from stare_lightning.tools import Tool, ToolsConfig, build_format
from stare_lightning.trainer.config import OptimConfig
from stare_lightning.trainer.cpu_threads import share_cores
from stare_lightning.trainer.loss_scale import loss_scale_for
from stare_lightning.trainer.optim import OptimizerSteps, build_optimizer
from stare_lightning.trainer.precision import compute_dtype
from stare_lightning.trainer.run_state import load_run_state, save_run_state


class STAREModule(LightningModule):
    def __init__(
        self,
        *,
        model_dir: str,
        model: ModelConfig,
        algorithm: AlgorithmConfig,
        rollout: RolloutConfig,
        optim: OptimConfig,
        forward: ForwardConfig,
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
        groups = {"model": model, "algorithm": algorithm, "rollout": rollout, "optim": optim, "forward": forward}
        hyperparameters = {k: asdict(v) for k, v in groups.items()}
        hyperparameters.update(model_dir=str(model_dir), seed=seed, tools=asdict(tools or ToolsConfig()))
        self.save_hyperparameters(hyperparameters)
        self.model_dir, self.seed, self.allowed_targets = str(model_dir), seed, list(allowed_targets)
        self.model_cfg, self.algorithm, self.rollout, self.optim = model, algorithm, rollout, optim
        self.plan = StepPlan.resolve(algorithm, rollout, forward)  # every decision the step takes, taken once
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.policy: torch.nn.Module | None = None  # built in ``configure_model``
        self.reference: torch.nn.Module | None = None  # there too, with a KL penalty (not with LoRA: ReferencePolicy)
        self.runner: StepRunner | None = None  # once the policy is built and placed (``on_fit_start``)
        self.rollouts: RolloutSource | None = None  # where the steps' rollouts come from
        self.engine = SyncedEngine(rollout, self.tokenizer, self.model_dir, seed=seed, lora=self.model_cfg.lora)
        # With a tool every rollout is an episode (rollout/episodes.py); the module owns the tool and closes it.
        self.tools, self.tool = tools or ToolsConfig(), tool
        self.call_format = build_format(self.tools.format, tool, self.tokenizer) if tool is not None else None
        self.controller = algorithm.stare.make_controller() if algorithm.stare.enabled else None
        self.entropy_coefficient = algorithm.entropy_bonus.make_coefficient()
        self.sign_controller = algorithm.entropy_control.make_step_controller()  # the PI controller, or None
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
        self.optimizer_steps: OptimizerSteps | None = None  # in ``setup``, where the strategy's precision is known
        self.last_rollout_samples: list[dict] = []

    @classmethod
    def from_config(
        cls, cfg, model_dir: str, val_benchmarks: Sequence[str] = (), tool: Tool | None = None
    ) -> STAREModule:
        """The module of a validated ``RunConfig``; ``val_benchmarks``: the validation data's benchmarks;
        ``tool``: the tool ``cfg.tools`` names, already built (its sandbox checked before the model loads)."""
        names = ("model", "algorithm", "rollout", "optim", "forward", "validation", "telemetry", "tools", "seed")
        settings = {name: getattr(cfg, name) for name in (*names, "allowed_targets")}
        sampling = benchmark_sampling(cfg.rollout, cfg.data.val_sets, val_benchmarks)
        return cls(model_dir=model_dir, val_sampling=sampling, tool=tool, **settings)

    # ----------------------------------------------------------------------------------------- models
    def setup(self, stage: str) -> None:
        if self.device.type == "cpu":
            share_cores(self.trainer.world_size, self.trainer.num_devices)
        self.optimizer_steps = OptimizerSteps(self.optim.grad_clip, loss_scale_for(self.trainer.strategy))

    def configure_model(self) -> None:
        if self.policy is not None:  # validate-then-fit calls this twice
            return
        self.policy = load_policy(self.model_dir, self.model_cfg)
        if self.algorithm.uses_reference() and self.model_cfg.lora is None:  # LoRA: the policy, adapters off
            self.reference = load_reference(self.model_dir, self.model_cfg)
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
        return self.engine.get(self.policy, dtype, log_dir=Path(self.trainer.default_root_dir) / "servers")

    def _sampler(self, engine=None):
        """What rollouts come from: the engine (by default the synced one), or tool-using episodes on top of it."""
        engine = engine if engine is not None else self._rollout_engine()
        if self.tool is None:
            return engine
        turns, workers = self.rollout.episode_turns(), self.tools.max_workers
        return ToolEpisodes(engine, self.tool, self.call_format, self.tokenizer, max_turns=turns, max_workers=workers)

    def on_fit_start(self) -> None:
        self.runner = StepRunner(
            self.plan,
            verifiers=self.verifiers,
            sampling=self.rollout.training_sampling(),
            pad_token_id=self.tokenizer.pad_token_id,
            policy=self.policy,
            reference=ReferencePolicy.of(self.policy, self.reference) if self.algorithm.uses_reference() else None,
            controller=self.controller,
            entropy_coefficient=self.entropy_coefficient,
            sign_controller=self.sign_controller,
            optimizer_step=self._optimizer_step,
            backward=self.optimizer_steps.backward(self.manual_backward),
            device=self.device,
            world_size=self.trainer.world_size,
            same_batch_entropy=self.same_batch_entropy,
        )
        engines = EngineAccess(self.engine, engine=self._rollout_engine, sampler=self._sampler)
        data, steps = self.trainer.datamodule, self.trainer.max_steps
        self.rollouts = rollout_source(self.rollout, self.runner, data, engines, seed=self.seed, max_steps=steps)

    def _stateful(self) -> dict:
        """What a checkpoint keeps besides weights, optimizer and telemetry (None: this run has no such part)."""
        parts = {"controller": self.controller, "entropy_coefficient": self.entropy_coefficient}
        if self.sign_controller is not None:  # absent otherwise, so other runs' checkpoints are as before
            parts["entropy_pi"] = self.sign_controller
        return {**parts, "optimizer_steps": self.optimizer_steps}

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        self.engine.mark_stale()
        load_run_state(checkpoint, self._stateful(), self.policy, self.model_dir, self.trainer.ckpt_path)

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        save_run_state(checkpoint, self._stateful(), self.policy, self.model_dir)

    # -------------------------------------------------------------------------------------- training
    def training_step(self, batch: list[dict], batch_idx: int) -> None:
        # The same seed on every rank: prompts are told apart by record id, mini-batches split over the global batch.
        timer, seed = StepTimer(self.device), derived_seed(self.seed, self.global_step)
        source = self.rollouts.take(batch, seed=seed, step=self.global_step, policy=self.policy)
        timer.lap(source.phase)
        collection, lr = source.collection, self.lr_schedulers().get_last_lr()[0]
        result = self.runner.learn(collection, seed=seed, lap=timer.lap)
        # A stale batch differs from the trainer by design, not by fault: measured, but judged only when fresh.
        logprobs = (result.batch.rollout_logprobs, result.scores.logprobs, result.batch.response_mask)
        canary = self.canary.update(*logprobs, judge=source.staleness == 0)
        timer.lap("telemetry")
        self.rollouts.publish(source, self.policy)
        timer.lap("sync")
        metrics = self.train_telemetry.compute(result, collection, lr=lr)
        metrics.update({f"train/{key}": value for key, value in canary.items()})
        metrics.update(self.optimizer_steps.metrics())
        metrics.update(source.metrics())
        timer.lap("telemetry")
        metrics.update(step_costs(timer, source.step_stats(), tokens=int(result.batch.attention_mask.sum())))
        self.last_rollout_samples = collection.samples()
        self.log_dict(metrics, on_step=True, on_epoch=False, batch_size=len(batch))

    def _optimizer_step(self, finite: bool) -> float | None:
        """One optimizer step, skipped (with a warning) when any rank saw a non-finite loss or gradient."""
        optimizer, scheduler = self.optimizers(), self.lr_schedulers()
        return self.optimizer_steps(
            optimizer, scheduler, self.policy, finite=finite, device=self.device, step=self.global_step
        )

    # ------------------------------------------------------------------------------------ validation
    def on_validation_epoch_start(self) -> None:
        if self.rollouts is not None:
            self.rollouts.drain()

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
        if self.rollouts is not None:
            self.rollouts.close()
        self.verifiers.close()
        self.engine.close()
        if self.tool is not None:
            self.tool.close()
