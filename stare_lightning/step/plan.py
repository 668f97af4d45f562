"""What one training step does, resolved once from the config: the step runner reads these fields, never the config.

Every decision that used to be re-derived inside the step (is there a scoring pass, when is STARE's
selection made, where the old log-probs come from, how the gate's entropy and the loss are normalised, how a
forward lays out its micro-batch) is a field of ``StepPlan``, computed by ``StepPlan.resolve`` and tested there.
The reference trainer's semantics are not a branch: the ``*_official`` algorithm recipes set the switches of
``AlgorithmConfig`` that these fields are resolved from. Collection's own switches (the dynamic-sampling filter
metric, what an exhausted generation budget does) are read by ``collect`` from the same config.
"""

from __future__ import annotations

from dataclasses import dataclass

from stare_lightning.algorithms import AlgorithmConfig
from stare_lightning.rollout.config import RolloutConfig
from stare_lightning.step.config import ForwardConfig
from stare_lightning.step.forward import PADDED, ForwardLayout
from stare_lightning.step.selection import SelectionTiming, TokenSelection


@dataclass(frozen=True)
class ForwardPlan:
    """How the policy's forwards over the step's rows run: the layout, the sampling temperature the statistics
    are taken at, the vocabulary chunk of the log-softmax and the token budget of a micro-batch."""

    temperature: float
    chunk_size: int
    micro_batch_tokens: int
    layout: ForwardLayout = PADDED


@dataclass(frozen=True)
class StepPlan:
    """One step's shape. ``scoring_pass``: a no-grad pass scores the batch before any update (else the update's
    first forward gives the rollout policy's statistics, and the gate and selection are telemetry only);
    ``token_selection``: STARE's selection (``step/selection.py``); ``selection``: when the applied selection is
    made; ``reselect``: before every optimizer step after the first; ``old_logprobs_from_forward``: on-policy old
    log-probs are the update forward's own, detached."""

    scoring_pass: bool
    token_selection: TokenSelection
    selection: SelectionTiming
    reselect: bool
    old_logprobs_from_forward: bool
    gate_aggregation: str  # an aggregation mode of ``aggregate_loss``
    loss_normalizer: str  # step | micro_batch
    balanced: bool  # the reference trainer's balancing (step/partition.py): rows dealt to ranks by workload,
    # mini-batches taken in that order, balanced micro-batches; else each rank's own rows, shuffled mini-batches,
    # consecutive micro-batches
    ppo_epochs: int
    mini_batches: int
    max_response_length: int
    group_size: int
    forward: ForwardPlan

    @classmethod
    def resolve(cls, algorithm: AlgorithmConfig, rollout: RolloutConfig, forward: ForwardConfig) -> StepPlan:
        """The plan of a run with these validated config groups."""
        selection = TokenSelection.resolve(algorithm, group_size=rollout.n)
        passes = ForwardPlan(
            temperature=rollout.temperature,
            chunk_size=forward.logprob_chunk_size,
            micro_batch_tokens=forward.micro_batch_tokens,
            layout=forward.layout(),
        )
        return cls(
            scoring_pass=algorithm.needs_scoring_pass(),
            token_selection=selection,
            selection=selection.timing,
            reselect=selection.reselect,
            old_logprobs_from_forward=algorithm.on_policy_old_logprobs == "forward" and algorithm.is_on_policy(),
            gate_aggregation=algorithm.gate_loss_agg(),
            loss_normalizer=algorithm.loss_normalizer,
            balanced=algorithm.micro_batch_partition == "balanced",
            ppo_epochs=algorithm.ppo_epochs,
            mini_batches=algorithm.mini_batches,
            max_response_length=rollout.max_new_tokens,
            group_size=rollout.n,
            forward=passes,
        )

    def pass_options(self) -> dict:
        """The keyword arguments of the no-grad passes over the step's batch (``score_batch`` and its kin)."""
        forward = self.forward
        return {
            "temperature": forward.temperature,
            "chunk_size": forward.chunk_size,
            "micro_batch_tokens": forward.micro_batch_tokens,
            "layout": forward.layout,
        }
