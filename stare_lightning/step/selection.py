"""STARE's gate and token selection, in one place: the entropy the gate reads, the controller and the adaptive
entropy coefficient that step on it, when the selection is made, what ranks the tokens, the omega weights and
re-selection.

The gate (``Gate``): H_k is the token mean of the rollout policy's entropy over every rank's response tokens;
STARE's controller compares its target to that mean, or to the entropy aggregated like the loss
(``algorithm.stare.gate_aggregation=like_loss``, the reference code's); the adaptive entropy coefficient reads H_k.

The selection (``TokenSelection``, resolved once by the step's plan). When it is made (``SelectionTiming``), from
``stare.scope``, ``stare.surprisal_source`` and the selector:
- ``micro_batch``: inside each micro-batch's forward, from its current (detached) or old statistics. Scope
  ``micro_batch`` always; scope ``sequence`` with the current statistics (a row's selection needs only that row).
- ``optimizer_step``: scopes ``step`` and ``group`` ranked by the current policy: once before the first optimizer
  step from the scoring pass (the policy has not moved yet), then again before every later optimizer step (PPO
  epochs, mini-batches) from a no-grad pass of the updated policy over the step's batch.
- ``step``: ranked by the old statistics, or by a selector that does not follow the policy (``random``): one
  selection from the scoring pass, kept for every optimizer step.
The paper ranks the current policy's surprisal; its reference code re-selects per micro-batch.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import StrEnum

import torch
from torch import Tensor

from stare_lightning.algorithms import (
    AdaptiveEntropyCoefficient,
    STAREController,
    TokenStats,
    aggregate_loss,
    entropy_sensitivity,
)
from stare_lightning.algorithms.config import STAREConfig
from stare_lightning.algorithms.entropy_controller import StepController
from stare_lightning.algorithms.selectors import STARE_SELECTORS
from stare_lightning.algorithms.stare import STARERule, stare_weights_for_scope
from stare_lightning.algorithms.stare_controller import GRPO_PARAMS, StepParams
from stare_lightning.distributed import all_reduce
from stare_lightning.distributed import rank as global_rank
from stare_lightning.seeds import derived_seed
from stare_lightning.step.batch import Experience, RolloutBatch
from stare_lightning.step.normalizer import step_normalizer
from stare_lightning.step.scoring import TokenScores

__all__ = [
    "Gate",
    "GateReading",
    "Selection",
    "SelectionTiming",
    "TokenSelection",
    "gate_entropy",
    "selection_timing",
    "token_mean",
]


# ------------------------------------------------------------------------------------------------------- gate
def token_mean(values: Tensor, mask: Tensor, *, device: torch.device) -> float:
    """The mean of ``values`` over every rank's valid tokens (float64 sums; NaN when there is none)."""
    valid = mask.to(torch.bool)
    total = torch.where(valid, values.detach().double(), torch.zeros((), dtype=torch.float64, device=values.device))
    sums = torch.stack([total.sum(), valid.sum().double()])
    total_sum, count = all_reduce(sums.to(device), device=device).tolist()
    return total_sum / count if count else float("nan")


def gate_entropy(entropy: Tensor, batch: RolloutBatch, aggregation: str, *, max_response_length: int) -> float:
    """The entropy that drives STARE's gate, over every rank's rows, aggregated by ``aggregation`` (the plan's
    ``gate_aggregation``): the token mean, or like the loss (``aggregate_loss`` under the step's global counts)."""
    normalizer = step_normalizer(batch, max_response_length=max_response_length, device=entropy.device)
    mask = batch.response_mask
    share = aggregate_loss(entropy.detach().double(), mask, aggregation, normalizer)
    return float(all_reduce(share, device=entropy.device))


@dataclass(frozen=True)
class GateReading:
    """The step's batch entropy: H_k (the token mean over every rank's response tokens) and the value STARE's gate
    compares with its target (H_k itself, or the entropy aggregated like the loss)."""

    entropy: float
    gate_value: float


@dataclass
class Gate:
    """What reads the step's batch entropy: the step controllers (``algorithms/entropy_controller.py``): STARE's
    controller, the adaptive entropy coefficient and a controller of token weights by advantage sign (the PI
    controller); any may be None, and the caller keeps and checkpoints their state. ``aggregation``: how STARE's gate
    aggregates the entropy (the plan's ``gate_aggregation``). ``measure`` only measures; ``advance`` moves every
    controller one step on a reading, so that each happens once per step and visibly."""

    aggregation: str
    controller: STAREController | None
    entropy_coefficient: AdaptiveEntropyCoefficient | None
    max_response_length: int
    device: torch.device
    sign_controller: StepController | None = None

    def measure(self, scores: TokenScores, batch: RolloutBatch) -> GateReading:
        """H_k over all ranks, and the gate's value (aggregated as ``aggregation`` says; H_k for the token mean)."""
        entropy = token_mean(scores.entropy, batch.response_mask, device=self.device)
        gate_value = entropy
        if self.controller is not None and self.aggregation != "token-mean":
            gate_value = gate_entropy(
                scores.entropy, batch, self.aggregation, max_response_length=self.max_response_length
            )
        return GateReading(entropy=entropy, gate_value=gate_value)

    def advance(self, reading: GateReading) -> StepParams:
        """The adaptive entropy coefficient, STARE's controller and the sign controller take their step on
        ``reading``; returns this step's parameters (plain GRPO's without a controller), with the sign controller's
        token weights when there is one."""
        if self.entropy_coefficient is not None:
            self.entropy_coefficient.update(reading.entropy)
        params = GRPO_PARAMS if self.controller is None else self.controller.update(reading.gate_value)
        if self.sign_controller is not None:
            params = replace(params, signs=self.sign_controller.update(reading.entropy))
        return params

    def metrics(self) -> dict[str, float]:
        """Every step controller's control signal after its last step (``StepController.metrics``)."""
        out: dict[str, float] = {}
        for part in (self.controller, self.entropy_coefficient, self.sign_controller):
            if part is not None:
                out.update(part.metrics())
        return out


# -------------------------------------------------------------------------------------------------- selection
class SelectionTiming(StrEnum):
    """When the selection that the loss applies is made (module docstring)."""

    STEP = "step"
    OPTIMIZER_STEP = "optimizer_step"
    MICRO_BATCH = "micro_batch"


def selection_timing(stare: STAREConfig) -> SelectionTiming:
    """When the selection that the loss applies is made, from ``stare.scope``, ``stare.surprisal_source`` and
    whether the selector follows the policy. With STARE off it is ``STEP``: the step-wide selection is still made,
    for the telemetry only."""
    if not stare.enabled:
        return SelectionTiming.STEP
    current = stare.surprisal_source == "current" and STARE_SELECTORS[stare.selector].follows_policy
    if stare.scope == "micro_batch" or (stare.scope == "sequence" and current):
        return SelectionTiming.MICRO_BATCH
    if current and stare.scope in ("step", "group"):
        return SelectionTiming.OPTIMIZER_STEP
    return SelectionTiming.STEP


@dataclass(frozen=True)
class Selection:
    """One STARE selection, as a loss applied it (or, with STARE off or its gate closed, would have)."""

    advantages: Tensor
    mask: Tensor
    phi: Tensor
    omega: Tensor | None  # None: every weight 1
    selected: Tensor  # bool [rows, width]


def _generator(seed: int | None) -> torch.Generator | None:
    return None if seed is None else torch.Generator().manual_seed(seed % (1 << 63))


@dataclass(frozen=True)
class TokenSelection:
    """STARE's selection as the run makes it, resolved once from ``algorithm.stare``: when it is made, over what
    scope, ranked by what (and so what the ranking reads), and the rule the step's W, M and gate complete.

    ``rule``: the variant, P, selector and ranking conventions (its W, M and gate are set per step by ``rule_for``);
    ``applies``: STARE is on (off, the selection is still made over the step, for the telemetry only);
    ``current``: ranked by the current policy's statistics (else by the scoring pass's, the old ones);
    ``needs_phi``, ``needs_entropy``: what the selector reads besides the log-probs.
    """

    rule: STARERule
    timing: SelectionTiming
    scope: str
    group_size: int
    applies: bool
    current: bool
    needs_phi: bool
    needs_entropy: bool

    @classmethod
    def resolve(cls, stare: STAREConfig, *, group_size: int) -> TokenSelection:
        selector = STARE_SELECTORS[stare.selector]
        return cls(
            rule=stare.rule(),
            timing=selection_timing(stare),
            scope=stare.scope,
            group_size=group_size,
            applies=stare.enabled,
            current=stare.surprisal_source == "current",
            needs_phi=selector.needs_phi,
            needs_entropy=selector.needs_entropy,
        )

    @property
    def reselect(self) -> bool:
        """Made again before every optimizer step after the first."""
        return self.timing is SelectionTiming.OPTIMIZER_STEP

    @property
    def in_loss(self) -> bool:
        """Made inside each micro-batch's loss."""
        return self.timing is SelectionTiming.MICRO_BATCH

    def rule_for(self, params: StepParams, *, gate_on: bool) -> STARERule:
        """The rule with this step's W and M, and the gate as given."""
        return replace(self.rule, w=params.w, m=params.m, gate_on=gate_on)

    def loss_forward_needs(self) -> tuple[bool, bool]:
        """(Phi, entropy): what a selection made inside the loss reads from the micro-batch's own forward."""
        if not (self.in_loss and self.current):
            return False, False
        return self.needs_phi, self.needs_entropy

    def over_step(
        self, scores: TokenScores, batch: RolloutBatch, params: StepParams, *, seed: int | None = None
    ) -> Selection:
        """The selection over the step's batch (gathered across ranks), from ``scores``. Its omega is None when no
        STARE weight applies (STARE off or its gate closed). ``seed``: the step's (a random selector draws from it,
        mixed with the rank, so the ranks' draws differ)."""
        (omega,), (stats,) = stare_weights_for_scope(
            [scores.logprobs],
            [batch.advantages],
            [batch.response_mask],
            scope=self.scope if self.scope != "micro_batch" else "step",
            group_size=self.group_size,
            sensitivity=[scores.phi],
            entropy=[scores.entropy],
            generator=_generator(None if seed is None else derived_seed(seed, global_rank())),
            rule=self.rule_for(params, gate_on=True),
        )
        applied = omega if self.applies and params.gate_on else None
        return Selection(batch.advantages, batch.response_mask, scores.phi, applied, stats.selected)

    def in_micro_batch(
        self, part: Experience, stats: TokenStats, old_logprobs: Tensor, params: StepParams, *, seed: int
    ) -> tuple[Tensor | None, Tensor | None]:
        """(omega, selected) the loss of ``part`` applies (omega None: all ones; selected None: no selection): its
        slice of the step's selection (timings ``step`` and ``optimizer_step``), or, with timing ``micro_batch``,
        one made here from this forward's statistics ``stats`` (the current policy) or the scoring pass's
        (``part``); ``seed``: this micro-batch's."""
        if not self.in_loss:
            return part.stare_weights, part.stare_selected
        current_phi, current_entropy = self.loss_forward_needs()
        ranked = stats.logprobs.detach() if self.current else old_logprobs
        (omega,), (selection,) = stare_weights_for_scope(
            [ranked.detach()],
            [part.advantages],
            [part.response_mask],
            scope=self.scope,
            sensitivity=[_sensitivity(stats) if current_phi else part.phi],
            entropy=[stats.entropy.detach() if current_entropy else part.entropy],
            generator=_generator(seed),
            rule=self.rule_for(params, gate_on=params.gate_on),
        )
        return (omega if params.gate_on else None), selection.selected


def _sensitivity(stats: TokenStats) -> Tensor:
    return entropy_sensitivity(
        stats.logprobs.detach(), stats.entropy.detach(), stats.sum_p2.detach(), stats.sum_p2_logp.detach()
    )
