"""The training system: policy, optional reference model, rollout engine, STARE loss and telemetry.

The LightningModule only wires parts together. Rollouts happen inside ``training_step`` (a dataloader
would prefetch and make them one update stale); the optimisation is manual because one rollout batch
feeds ``ppo_epochs x mini_batches`` optimizer steps, each accumulated over token-budget micro-batches
whose losses are normalised by counts taken over the whole optimizer step on every rank.
"""

from __future__ import annotations

import math
import os
import time
import warnings
from dataclasses import asdict

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule
from transformers import AutoModelForCausalLM, AutoTokenizer

from stare_lightning.algorithms import (
    AdaptiveEntropyCoefficient,
    LossNormalizer,
    entropy_sensitivity,
    gather_variable_length,
    policy_loss,
    stare_weights_for_scope,
)
from stare_lightning.algorithms.rollout_correction import mismatch_is_weights
from stare_lightning.collect import collect_experience
from stare_lightning.config.schema import RunConfig
from stare_lightning.experience import Experience, micro_batches, mini_batch_rows
from stare_lightning.forward import response_token_stats
from stare_lightning.models.sharding import shard_model
from stare_lightning.optim import build_optimizer
from stare_lightning.rewards.pool import VerifierPool
from stare_lightning.rollout.base import SamplingParams, prompt_seeds
from stare_lightning.rollout.canary import LogprobCanary
from stare_lightning.rollout.factory import build_engine
from stare_lightning.telemetry import TrainTelemetry, ValidationTelemetry


class STAREModule(LightningModule):
    def __init__(self, cfg: RunConfig, model_dir: str) -> None:
        super().__init__()
        self.cfg = cfg
        self.model_dir = str(model_dir)
        self.automatic_optimization = False
        self.save_hyperparameters({"config": asdict(cfg), "model_dir": self.model_dir})
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.policy: torch.nn.Module | None = None
        self.reference: torch.nn.Module | None = None
        self.engine = None
        self._engine_stale = True
        alg = cfg.algorithm
        self.controller = alg.stare.make_controller() if alg.stare.enabled else None
        self.entropy_coefficient = (
            AdaptiveEntropyCoefficient(
                target=alg.entropy_target, init_coef=alg.entropy_coef, lr=alg.entropy_coef_lr, max_coef=alg.entropy_coef_max
            )
            if alg.entropy_target is not None
            else None
        )
        self.canary = LogprobCanary(threshold=cfg.rollout.canary_threshold, patience=cfg.rollout.canary_patience)
        self.verifiers = VerifierPool()
        self.train_telemetry = TrainTelemetry(cfg)
        self.val_telemetry = ValidationTelemetry(cfg)
        self.nonfinite_skipped = 0

    # ----------------------------------------------------------------------------------------- models
    def setup(self, stage: str) -> None:
        if self.device.type == "cpu" and self.trainer.world_size > 1 and "OMP_NUM_THREADS" not in os.environ:
            # Several CPU ranks on one machine: split the cores, or OpenMP's spinning threads of each rank
            # fight the others' and every step slows down many times over. An explicit OMP_NUM_THREADS wins
            # (launchers such as torchrun set it, and only they know how many ranks share the machine).
            per_rank = max(1, (os.cpu_count() or 1) // max(self.trainer.num_devices, 1))
            torch.set_num_threads(per_rank)

    def configure_model(self) -> None:
        if self.policy is not None:  # validate-then-fit calls this twice
            return
        dtype = getattr(torch, self.cfg.model.dtype)
        self.policy = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=dtype)
        if self.cfg.model.gradient_checkpointing:
            self.policy.gradient_checkpointing_enable()
        if self.cfg.algorithm.uses_reference():
            self.reference = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=dtype).eval()
            self.reference.requires_grad_(False)
        if self.device_mesh is not None:
            mp_policy = getattr(self.trainer.strategy, "mixed_precision_policy", None)
            shard_model(self.policy, self.device_mesh, mp_policy=mp_policy)
            if self.reference is not None:
                shard_model(self.reference, self.device_mesh, mp_policy=mp_policy)

    def configure_optimizers(self):
        optimizer, scheduler = build_optimizer(
            self.policy.parameters(), self.cfg.optim, total_steps=self.trainer.max_steps,
            extra_allowed=self.cfg.allowed_targets,
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def _rollout_engine(self):
        # Validation runs under inference mode; an engine built or synced there would hold inference tensors
        # that a later sync during training may not update in place.
        with torch.inference_mode(False):
            if self.engine is None:
                self.engine = build_engine(
                    self.cfg.rollout, self.policy, self.tokenizer, self.model_dir, seed=self.cfg.seed,
                    compute_dtype=self._compute_dtype(),
                )
                self._engine_stale = self.engine_holds_copy()
            if self._engine_stale:
                self.engine.sync_weights(self.policy)
                self._engine_stale = False
        return self.engine

    def _compute_dtype(self) -> torch.dtype:
        """The dtype forward passes run in: FSDP2's param_dtype, Lightning's half precision, else the weights'."""
        mp_policy = getattr(self.trainer.strategy, "mixed_precision_policy", None)
        if mp_policy is not None:
            return mp_policy.param_dtype
        precision = str(self.trainer.precision)
        if precision.startswith("bf16"):
            return torch.bfloat16
        if precision.startswith("16"):
            return torch.float16
        return next(self.policy.parameters()).dtype

    def engine_holds_copy(self) -> bool:
        return getattr(self.engine, "holds_weight_copy", True)

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        self._engine_stale = True
        state = checkpoint.get("stare_lightning", {})
        if self.controller is not None and "controller" in state:
            self.controller.load_state_dict(state["controller"])
        if self.entropy_coefficient is not None and "entropy_coefficient" in state:
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
        started = time.perf_counter()
        cfg, alg = self.cfg, self.cfg.algorithm
        rollout = cfg.rollout
        params = SamplingParams(
            n=rollout.n, max_new_tokens=rollout.max_new_tokens, temperature=rollout.temperature,
            top_p=rollout.top_p, top_k=rollout.top_k,
        )
        experience, collection = collect_experience(
            batch, self._rollout_engine(), self.verifiers, params, alg,
            pad_token_id=self.tokenizer.pad_token_id, more_prompts=self._more_prompts, seed=self._step_seed(),
            all_ranks_agree=lambda stop: bool(self._all_reduce(torch.tensor(float(stop)), dist.ReduceOp.MIN) > 0),
        )
        experience = experience.to(self.device)
        lr = self.lr_schedulers().get_last_lr()[0]
        # STARE's gate, the adaptive entropy bonus and off-policy updates need the rollout policy's
        # statistics before the first loss; plain on-policy GRPO reuses its first forward instead.
        prepass = alg.needs_old_logprob_pass() or alg.uses_adaptive_entropy_coef()
        if prepass:
            self._score_with_rollout_policy(experience)
            entropy = self.train_telemetry.measure_entropy(experience)
            if self.entropy_coefficient is not None:
                self.entropy_coefficient.update(entropy)
            step = self._stare_step(experience, entropy)
        optimizer_stats = self._update(experience)
        if not prepass:
            entropy = self.train_telemetry.measure_entropy(experience)
            step = self._stare_step(experience, entropy)  # telemetry only: no controller, weights stay 1
        canary = self.canary.update(experience.rollout_logprobs, experience.old_logprobs, experience.response_mask)
        self._engine_stale = True
        self._rollout_engine()  # weight sync right after the optimizer steps, on every rank
        metrics = self.train_telemetry.step(
            experience=experience, collection=collection, entropy=entropy, stare=step, canary=canary,
            optimizer=optimizer_stats, lr=lr,
        )
        metrics["train/nonfinite_skipped"] = float(self.nonfinite_skipped)
        metrics["train/time/step_s"] = time.perf_counter() - started
        metrics["train/memory/peak_gib"] = _peak_memory_gib(self.device)
        self.last_rollout_samples = _samples_for_dump(experience, collection)
        self.log_dict(metrics, on_step=True, on_epoch=False, batch_size=len(batch))

    def _more_prompts(self, count: int, attempt: int) -> list[dict]:
        return self.trainer.datamodule.more_prompts(count, step=self.global_step, attempt=attempt)

    def _step_seed(self) -> int:
        # The same on every rank: rollouts tell prompts apart by record id and mini-batches are split
        # over the global batch, so the seed must not depend on the rank.
        return self.cfg.seed * 1_000_003 + self.global_step

    @torch.no_grad()
    def _score_with_rollout_policy(self, experience: Experience) -> None:
        """Old log-probs, entropy and the Phi reductions in one no-grad pass, micro-batch by micro-batch."""
        self.policy.eval()
        parts = [
            response_token_stats(
                self.policy, part, temperature=self.cfg.rollout.temperature,
                chunk_size=self.cfg.optim.logprob_chunk_size, with_entropy=True, with_sensitivity=True,
            )
            for part in micro_batches(experience, self.cfg.optim.micro_batch_tokens)
        ]
        self.policy.train()
        _store_rollout_stats(experience, parts)

    def _stare_step(self, experience: Experience, entropy: float) -> dict:
        """Controller update and token weights (all ones when STARE is off or its gate is closed)."""
        stare = self.cfg.algorithm.stare
        gate_on, w, m = False, 1.0, 1.0
        if self.controller is not None:
            params = self.controller.update(entropy)
            gate_on, w, m = params.gate_on, params.w, params.m
        scope = stare.scope if stare.scope != "micro_batch" else "step"  # micro_batch scope is applied per micro-batch
        weights, stats = stare_weights_for_scope(
            experience.old_logprobs, experience.advantages, experience.response_mask, scope=scope,
            group_size=self.cfg.rollout.n, gather=gather_variable_length, variant=stare.variant,
            top_ratio=stare.top_ratio, w=w, m=m, gate_on=True, selector=stare.selector,
            sensitivity=experience.phi,
        )
        experience.selected = stats.selected
        experience.token_weights = weights if gate_on else torch.ones_like(weights)
        return {"gate_on": gate_on, "w": w, "m": m, "stats": stats, "enabled": self.controller is not None}

    def _update(self, experience: Experience) -> dict:
        alg = self.cfg.algorithm
        optimizer, scheduler = self.optimizers(), self.lr_schedulers()
        generator = torch.Generator().manual_seed(self._step_seed())
        offset, total_rows = self._global_row_offset(experience.num_rows)
        budget = self.cfg.optim.micro_batch_tokens
        # Ranks with fewer micro-batches (or none in a mini-batch) run this one at zero weight, so every rank
        # runs the same number of forward/backward collectives.
        filler = next(micro_batches(experience.select(slice(0, 1)), budget))
        sums: dict[str, float] = {}
        grad_norms, first_pass = [], []
        for _ in range(alg.ppo_epochs):
            split = mini_batch_rows(experience.num_rows, alg.mini_batches, generator, offset=offset, total_rows=total_rows)
            for rows in split:
                mini = experience.select(rows.to(experience.input_ids.device))
                normalizer = self._normalizer(mini)
                parts = list(micro_batches(mini, budget))
                steps = int(self._all_reduce(torch.tensor(float(len(parts))), dist.ReduceOp.MAX))
                finite = True
                for index in range(steps):
                    part = parts[index] if index < len(parts) else filler
                    loss, stats, token_stats = self._micro_batch_loss(part, normalizer)
                    if experience.old_logprobs is None and index < len(parts):
                        first_pass.append(token_stats)
                    scale = float(index < len(parts)) * self.trainer.world_size
                    if not torch.isfinite(loss):
                        finite = False
                        loss = torch.nan_to_num(loss, nan=0.0, posinf=0.0, neginf=0.0) * 0.0
                    self.manual_backward(loss * scale)
                    if index < len(parts):
                        stats["loss"] = loss.detach()
                        for key, value in stats.items():
                            sums[key] = sums.get(key, 0.0) + float(value)
                grad_norm = self._clip_gradients()
                finite = finite and math.isfinite(grad_norm)
                all_finite = self._all_reduce(torch.tensor(float(finite)), dist.ReduceOp.MIN) > 0
                if all_finite:
                    optimizer.step()
                    grad_norms.append(grad_norm)
                else:
                    self.nonfinite_skipped += 1
                    warnings.warn(
                        f"non-finite loss or gradient at step {self.global_step}: optimizer step skipped "
                        f"({self.nonfinite_skipped} so far)",
                        RuntimeWarning,
                        stacklevel=2,
                    )
                optimizer.zero_grad(set_to_none=True)
                scheduler.step()
                sums["optimizer_steps"] = sums.get("optimizer_steps", 0.0) + 1.0
        if experience.old_logprobs is None:  # on-policy without a pre-pass: keep the first forward's statistics
            _store_rollout_stats(experience, first_pass)
        sums["grad_norm"] = sum(grad_norms) / len(grad_norms) if grad_norms else float("nan")
        return sums

    def _micro_batch_loss(self, part: Experience, normalizer: LossNormalizer):
        cfg, alg = self.cfg, self.cfg.algorithm
        on_policy_first_pass = part.old_logprobs is None
        stats = response_token_stats(
            self.policy, part, temperature=cfg.rollout.temperature, chunk_size=cfg.optim.logprob_chunk_size,
            with_entropy=alg.needs_entropy() or on_policy_first_pass, with_sensitivity=on_policy_first_pass,
        )
        old_logprobs = stats.logprobs.detach() if on_policy_first_pass else part.old_logprobs
        weights = part.token_weights
        if alg.stare.enabled and alg.stare.scope == "micro_batch":
            source = stats.logprobs.detach() if alg.stare.surprisal_source == "current" else part.old_logprobs
            step = self.controller.last_params  # this step's values (w, m may already hold the next step's)
            weights, _ = stare_weights_for_scope(
                source, part.advantages, part.response_mask, scope="micro_batch", variant=alg.stare.variant,
                top_ratio=alg.stare.top_ratio, w=step.w, m=step.m, gate_on=step.gate_on,
                selector=alg.stare.selector, sensitivity=part.phi,
            )
        if cfg.rollout.mismatch_correction != "none":
            # Truncated importance sampling of the engine/trainer mismatch (the engine sampled, the trainer learns).
            correction = mismatch_is_weights(
                old_logprobs, part.rollout_logprobs, part.response_mask, level=cfg.rollout.mismatch_correction,
                mode=cfg.rollout.mismatch_mode, cap=cfg.rollout.mismatch_cap,
            )
            weights = correction if weights is None else weights * correction
        ref_logprobs = None
        if self.reference is not None:
            with torch.no_grad():
                ref_logprobs = response_token_stats(
                    self.reference, part, temperature=cfg.rollout.temperature,
                    chunk_size=cfg.optim.logprob_chunk_size, with_entropy=False,
                ).logprobs
        coef = self.entropy_coefficient.coef if self.entropy_coefficient is not None else alg.entropy_coef
        loss, loss_stats = policy_loss(
            stats.logprobs, old_logprobs, part.advantages, part.response_mask, alg, normalizer,
            token_weights=weights, ref_logprobs=ref_logprobs,
            entropy=stats.entropy if alg.needs_entropy() else None, entropy_coef=coef,
        )
        return loss, loss_stats, stats

    def _normalizer(self, mini: Experience) -> LossNormalizer:
        counts = torch.tensor(
            [float(mini.response_mask.sum()), float(mini.response_mask.any(-1).sum())], device=self.device
        )
        counts = self._all_reduce(counts, dist.ReduceOp.SUM)
        return LossNormalizer(
            num_tokens=max(int(counts[0]), 1), num_sequences=max(int(counts[1]), 1),
            max_response_length=self.cfg.rollout.max_new_tokens,
        )

    def _global_row_offset(self, num_rows: int) -> tuple[int, int]:
        """Where this rank's rows start in the global batch (ranks in order), and the global row count."""
        counts = torch.zeros(max(self.trainer.world_size, 1), dtype=torch.long)
        counts[self.global_rank] = num_rows
        counts = self._all_reduce(counts, dist.ReduceOp.SUM).tolist()
        return sum(counts[: self.global_rank]), sum(counts)

    def _clip_gradients(self) -> float:
        params = [p for p in self.policy.parameters() if p.grad is not None]
        max_norm = self.cfg.optim.grad_clip if self.cfg.optim.grad_clip > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        if hasattr(norm, "full_tensor"):  # a DTensor under FSDP2
            norm = norm.full_tensor()
        return float(norm)

    def _all_reduce(self, tensor: torch.Tensor, op) -> torch.Tensor:
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            tensor = tensor.to(self.device)
            dist.all_reduce(tensor, op=op)
        return tensor

    # ------------------------------------------------------------------------------------ validation
    def validation_step(self, batch: list[dict], batch_idx: int) -> None:
        rollout = self.cfg.rollout
        params = SamplingParams(
            n=rollout.val_n, max_new_tokens=rollout.max_new_tokens, temperature=rollout.val_temperature,
            top_p=rollout.val_top_p,
        )
        engine = self._rollout_engine()
        # Seeded by record id: validation scores do not depend on the number of ranks or the batch size.
        seeds = prompt_seeds(self.cfg.seed * 7919, [str(item["id"]) for item in batch], params.n)
        rollouts = engine.generate([item["prompt_ids"] for item in batch], params, seeds=seeds)
        calls = [
            (batch[row // params.n]["verifier"], text, batch[row // params.n]["answer"], batch[row // params.n].get("metadata", {}))
            for row, text in enumerate(rollouts.texts)
        ]
        scores = self.verifiers.score(calls)
        self.val_telemetry.update(rollouts, scores)

    def on_validation_epoch_end(self) -> None:
        self.log_dict(self.val_telemetry.compute(), on_step=False, on_epoch=True, sync_dist=False)
        self.val_telemetry.reset()

    def teardown(self, stage: str) -> None:
        if stage != "fit":  # `fit` validates first and keeps its engine and verifier workers for training
            return
        self.verifiers.close()
        if self.engine is not None:
            self.engine.close()  # lets a sweep start the next run's engine in this process
            self.engine, self._engine_stale = None, True


def _peak_memory_gib(device: torch.device) -> float:
    """Peak accelerator memory of this process, or its peak resident memory on a CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def _store_rollout_stats(experience: Experience, parts: list) -> None:
    """Write per-micro-batch token statistics (trimmed widths, consecutive rows) back as padded step tensors."""
    width = experience.response_width

    def padded(name: str) -> torch.Tensor:
        values = [getattr(stats, name).detach().float() for stats in parts]
        return torch.cat([torch.nn.functional.pad(v, (0, width - v.shape[1])) for v in values])

    experience.old_logprobs = padded("logprobs")
    for name in ("entropy", "sum_p2", "sum_p2_logp"):
        setattr(experience, name, padded(name))
    experience.phi = entropy_sensitivity(
        experience.old_logprobs, experience.entropy, experience.sum_p2, experience.sum_p2_logp
    )


def _samples_for_dump(experience: Experience, collection) -> list[dict]:
    """Per prompt group: prompt, answer, responses, rewards and advantages (read by ``RolloutSampleDump``)."""
    n = collection.kept_correct.shape[1]
    rewards, advantages = experience.rewards.tolist(), experience.advantages.tolist()
    return [
        {
            "id": item.get("id"),
            "prompt": item.get("prompt_text"),
            "answer": item.get("answer"),
            "responses": collection.kept_texts[g * n : (g + 1) * n],
            "rewards": rewards[g * n : (g + 1) * n],
            "advantages": advantages[g * n : (g + 1) * n],
        }
        for g, item in enumerate(collection.kept_items)
    ]
