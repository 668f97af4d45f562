"""One training step without Lightning: collect, then score -> gate -> select -> update, for every algorithm.

``StepRunner`` is handed what it works on (the policy, the optional reference policy, the step controllers: STARE's
controller, the adaptive entropy coefficient and the PI controller, whose state the caller keeps and checkpoints)
and the two things the trainer does its own way: ``backward`` and ``optimizer_step`` (clip, then step or skip; it
returns the gradient norm, or None when it skipped). Every decision comes from the ``StepPlan``. The runner returns
a ``StepResult`` for telemetry to log; it neither logs nor reads telemetry.

The stages: ``collect`` rolls out through the injected sampler, verifies, computes advantages and filters
groups; ``learn`` then (with the reference's balancing) deals the step's rows to ranks by workload, scores the
batch with a no-grad pass of the rollout policy (when the plan has one), lets the gate take its step on the
batch entropy, makes STARE's step-wide selection (timings ``step`` and ``optimizer_step``) and runs the update:
``ppo_epochs x mini_batches`` optimizer steps, each over token-budget micro-batches. A plan without a scoring
pass has nothing that acts on the gate or the selection (plain on-policy GRPO: no controller, no adaptive
coefficient); the update's first forward scores the batch, and the gate and the selection made from it
afterwards only describe what STARE would have done.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist
from torch import Tensor

from stare_lightning import distributed
from stare_lightning.algorithms import AdaptiveEntropyCoefficient, STAREController
from stare_lightning.algorithms.entropy_controller import StepController
from stare_lightning.algorithms.stare_controller import GRPO_PARAMS, StepParams
from stare_lightning.models.reference import ReferencePolicy
from stare_lightning.rewards.pool import VerifierPool
from stare_lightning.rollout.base import RolloutEngine, SamplingParams
from stare_lightning.step.batch import Experience, RolloutBatch, filler_micro_batch, micro_batches, mini_batch_rows
from stare_lightning.step.collect import Collection, collect
from stare_lightning.step.loss import MicroBatchLoss, micro_batch_loss
from stare_lightning.step.normalizer import step_normalizer
from stare_lightning.step.partition import balanced_micro_batches, balanced_rank_rows
from stare_lightning.step.plan import StepPlan
from stare_lightning.step.scoring import (
    TokenScores,
    response_logits,
    same_batch_entropy_change,
    score_batch,
    scores_from_logits,
)
from stare_lightning.step.selection import Gate, Selection


@dataclass(frozen=True)
class StepResult:
    """What one step did: the batch it trained on, the rollout policy's statistics, the gate and what the update
    reports (every selection applied, each real micro-batch's loss sums, each optimizer step's gradient norm)."""

    batch: RolloutBatch
    scores: TokenScores
    entropy: float  # H_k: token mean over every rank's response tokens
    params: StepParams
    selections: list[Selection]
    micro_batch_sums: list[dict[str, Tensor]]  # ``policy_loss``'s sums and the micro-batch's ``loss``
    grad_norms: list[float | None]  # per optimizer step; None: skipped (non-finite)
    entropy_change: tuple[Tensor, Tensor] | None = None  # (realised, first-order) on the step's own tokens
    control: dict[str, float] = field(default_factory=dict)  # the step controllers' signals (``Gate.metrics``)


@dataclass
class _Update:
    """What the update loop gathers as it goes."""

    selections: list[Selection]
    micro_batch_sums: list[dict[str, Tensor]]
    grad_norms: list[float | None]
    first_pass: TokenScores | None = None


class StepRunner:
    def __init__(
        self,
        plan: StepPlan,
        *,
        verifiers: VerifierPool,
        sampling: SamplingParams,
        pad_token_id: int,
        policy: torch.nn.Module,
        optimizer_step: Callable[[bool], float | None],
        backward: Callable[[Tensor], None] = Tensor.backward,
        reference: ReferencePolicy | None = None,
        controller: STAREController | None = None,
        entropy_coefficient: AdaptiveEntropyCoefficient | None = None,
        sign_controller: StepController | None = None,
        device: torch.device | None = None,
        world_size: int = 1,
        same_batch_entropy: bool = False,
    ) -> None:
        self.plan = plan
        self.verifiers, self.sampling, self.pad_token_id = verifiers, sampling, pad_token_id
        self.policy, self.reference = policy, reference
        self.optimizer_step, self.backward = optimizer_step, backward
        self.controller, self.entropy_coefficient = controller, entropy_coefficient
        self.device = device or torch.device("cpu")
        self.gate = Gate(
            plan.gate_aggregation,
            controller,
            entropy_coefficient,
            plan.max_response_length,
            self.device,
            sign_controller,
        )
        self.selection = plan.token_selection
        self.world_size = world_size
        self.same_batch_entropy = same_batch_entropy

    def collect(
        self,
        prompts: list[dict],
        sampler: RolloutEngine,
        *,
        seed: int,
        more_prompts: Callable[[int, int], list[dict]] | None = None,
    ) -> Collection:
        """The step's rollouts from ``sampler``, verified, with advantages, filtered (``step.collect``);
        ``more_prompts(count, attempt)`` draws the prompts of further generation batches."""
        return collect(
            prompts,
            sampler,
            self.verifiers,
            self.sampling,
            self.plan.collection,
            self.plan.advantage,
            pad_token_id=self.pad_token_id,
            more_prompts=more_prompts,
            seed=seed,
        )

    def learn(self, collection: Collection, *, seed: int, lap: Callable[[str], None] = lambda _: None) -> StepResult:
        """Score, gate, select and update on ``collection``'s batch. ``seed``: the same on every rank (it orders
        the mini-batches); ``lap(phase)``: called as each phase ends, for a step timer."""
        batch = collection.batch
        if self.plan.balanced:  # the reference trainer deals the step's rows to ranks before scoring them
            batch = balanced_rank_rows(batch, self.pad_token_id)
        batch = batch.to(self.device)
        logits_before = self._response_logits(batch) if self.same_batch_entropy else None
        lap("telemetry")
        scores = self._score(batch, logits_before) if self.plan.scoring_pass else None
        entropy, params = self._gate(scores, batch) if scores is not None else (float("nan"), GRPO_PARAMS)
        experience = self._experience(batch, scores, params, seed)
        lap("score")
        update = self._update(experience, params, seed)
        lap("update")
        selections = update.selections
        if scores is None:  # the update's first forward scored the batch; what STARE would have done, for telemetry
            scores = update.first_pass
            entropy, params = self._gate(scores, batch)
            selections = [self.selection.over_step(scores, batch, params, seed=seed)]
        change = None
        if logits_before is not None:
            change = same_batch_entropy_change(self.policy, batch, logits_before, **self.plan.pass_options())
        lap("telemetry")
        return StepResult(
            batch=batch,
            scores=scores,
            entropy=entropy,
            params=params,
            selections=selections,
            micro_batch_sums=update.micro_batch_sums,
            grad_norms=update.grad_norms,
            entropy_change=change,
            control=self.gate.metrics(),
        )

    # ------------------------------------------------------------------------------------ score, gate, select
    def _gate(self, scores: TokenScores, batch: RolloutBatch) -> tuple[float, StepParams]:
        """H_k, and this step's STARE parameters once the gate's controller has stepped on it."""
        reading = self.gate.measure(scores, batch)
        return reading.entropy, self.gate.advance(reading)

    def _response_logits(self, batch: RolloutBatch) -> list[Tensor]:
        forward = self.plan.forward
        return response_logits(self.policy, batch, micro_batch_tokens=forward.micro_batch_tokens, layout=forward.layout)

    def _score(self, batch: RolloutBatch, logits: list[Tensor] | None) -> TokenScores:
        """The scoring pass: from the logits the same-batch telemetry already holds, else a forward."""
        if logits is not None:
            return scores_from_logits(logits, batch, **self.plan.pass_options())
        return score_batch(self.policy, batch, **self.plan.pass_options())

    def _experience(self, batch: RolloutBatch, scores: TokenScores | None, params: StepParams, seed: int) -> Experience:
        """The batch with every per-token input of the loss; with timing ``micro_batch`` the loss selects."""
        if scores is None:
            return Experience.build(batch, old_logprobs=None, phi=None, stare_weights=None, stare_selected=None)
        selection = None if self.selection.in_loss else self.selection.over_step(scores, batch, params, seed=seed)
        return Experience.build(
            batch,
            old_logprobs=scores.logprobs,
            phi=scores.phi,
            entropy=scores.entropy,
            stare_weights=selection.omega if selection else None,
            stare_selected=selection.selected if selection else None,
        )

    def _reselect(self, experience: Experience, params: StepParams, seed: int) -> Experience:
        """The step's selection made again by the policy as it is now (timing ``optimizer_step``)."""
        scores = score_batch(self.policy, experience, **self.plan.pass_options())
        selection = self.selection.over_step(scores, experience, params, seed=seed)
        return replace(experience, stare_weights=selection.omega, stare_selected=selection.selected)

    # ----------------------------------------------------------------------------------------------- update
    def _update(self, experience: Experience, params: StepParams, seed: int) -> _Update:
        """``ppo_epochs x mini_batches`` optimizer steps on ``experience``, each over token-budget micro-batches.

        Ranks with fewer micro-batches (or none in a mini-batch) run a zero-weight filler micro-batch, so every
        rank runs the same forward/backward collectives. A non-finite loss on any rank skips the optimizer step.
        """
        plan = self.plan
        generator = torch.Generator().manual_seed(seed)
        filler = filler_micro_batch(experience)
        record = _Update(selections=[], micro_batch_sums=[], grad_norms=[])
        first_pass = [] if experience.old_logprobs is None else None
        for _ in range(plan.ppo_epochs):
            for rows in self._mini_batch_rows(experience.num_rows, generator):
                if plan.reselect and params.gate_on and record.grad_norms:  # not before the first optimizer step
                    experience = self._reselect(experience, params, seed)
                mini = experience.select(rows.to(experience.input_ids.device))
                normalizer = step_normalizer(mini, max_response_length=plan.max_response_length, device=self.device)
                parts = self._micro_batches(mini)
                count = torch.tensor(float(len(parts)))
                steps = int(distributed.all_reduce(count, dist.ReduceOp.MAX, self.device))
                finite = True
                for step in range(steps):
                    real = step < len(parts)
                    part = parts[step] if real else filler
                    result = self._micro_batch_loss(part, normalizer, params, seed=seed + len(record.micro_batch_sums))
                    loss = result.loss
                    if not torch.isfinite(loss):
                        finite = False
                        loss = torch.nan_to_num(loss, nan=0.0, posinf=0.0, neginf=0.0) * 0.0
                    self.backward(loss * (float(real) * self.world_size))
                    if real:
                        self._record(record, part, result, loss, first_pass)
                record.grad_norms.append(self.optimizer_step(finite))
        if first_pass:
            record.first_pass = TokenScores.from_micro_batches(first_pass, experience.response_width)
        return record

    def _mini_batch_rows(self, num_rows: int, generator: torch.Generator) -> list[Tensor]:
        """This rank's rows of each mini-batch: in the order the rows are dealt when balanced (the reference
        actor splits its rows as they come), else a shuffled split of the global batch (``mini_batch_rows``)."""
        if self.plan.balanced:  # ranks hold equal counts, or differ by one (step/partition.py)
            most = int(distributed.all_reduce(torch.tensor(float(num_rows)), dist.ReduceOp.MAX, self.device))
            parts = torch.arange(most).tensor_split(self.plan.mini_batches)
            return [part[part < num_rows] for part in parts if len(part)]
        offset, total_rows = distributed.row_offset(num_rows, self.device)
        return mini_batch_rows(num_rows, self.plan.mini_batches, generator, offset=offset, total_rows=total_rows)

    def _micro_batches(self, mini: Experience) -> list[Experience]:
        forward = self.plan.forward
        if self.plan.balanced:
            return balanced_micro_batches(mini, forward.micro_batch_tokens, self.device)
        return list(micro_batches(mini, forward.micro_batch_tokens, packed=forward.layout.packed))

    def _micro_batch_loss(self, part: Experience, normalizer, params: StepParams, *, seed: int) -> MicroBatchLoss:
        coefficient = self.entropy_coefficient
        forward = self.plan.forward
        return micro_batch_loss(
            self.policy,
            self.reference,
            part,
            normalizer,
            self.plan.loss,
            params=params,
            entropy_coef=coefficient.coef if coefficient is not None else self.plan.loss.objective.entropy_coef,
            temperature=forward.temperature,
            chunk_size=forward.chunk_size,
            layout=forward.layout,
            selection=self.selection,
            seed=seed,
        )

    @staticmethod
    def _record(record: _Update, part: Experience, result: MicroBatchLoss, loss: Tensor, first_pass) -> None:
        """What one real micro-batch reports; its token statistics join ``first_pass`` when one is kept."""
        record.micro_batch_sums.append({**result.sums, "loss": loss.detach()})
        if result.stare_selected is not None:  # the selection this micro-batch's loss applied
            record.selections.append(
                Selection(part.advantages, part.response_mask, part.phi, result.stare_omega, result.stare_selected)
            )
        if first_pass is not None:
            first_pass.append(result.token_stats)
