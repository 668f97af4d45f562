"""What one training step does, resolved once from the config: the step reads these specs, never the config.

Every decision inside the step (is there a scoring pass, when is STARE's selection made, where the old log-probs
come from, how the gate's entropy and the loss are normalised, how a forward lays out its micro-batch, how the
rollouts are collected) is a field of ``StepPlan``, computed by ``StepPlan.resolve`` and tested there. Each part of
the step gets only its own spec: collection the ``collection`` and ``advantage`` sub-groups, the gate its
aggregation, the selection STARE's settings, each micro-batch's loss a ``LossPlan``. The reference trainer's
semantics are not a branch: the ``*_official`` algorithm recipes set the switches these fields are resolved from.
"""

from __future__ import annotations

from dataclasses import dataclass

from stare_lightning.algorithms import AlgorithmConfig
from stare_lightning.algorithms.config_groups import AdvantageConfig, CollectionConfig, MismatchConfig
from stare_lightning.algorithms.objective import LossSpec
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
class LossPlan:
    """What each micro-batch's loss reads: the objective (``LossSpec``), the mismatch correction's weights, whether
    a token mean is each micro-batch's own (the reference trainer's normaliser), whether on-policy old log-probs
    are the update forward's own even after a scoring pass, and whether the loss needs the entropy with gradient."""

    objective: LossSpec
    mismatch: MismatchConfig
    micro_batch_token_mean: bool
    old_logprobs_from_forward: bool
    needs_entropy: bool

    @classmethod
    def resolve(cls, algorithm: AlgorithmConfig) -> LossPlan:
        update = algorithm.update
        return cls(
            objective=LossSpec.of(algorithm),
            mismatch=algorithm.mismatch,
            micro_batch_token_mean=update.loss_normalizer == "micro_batch" and update.loss_agg == "token-mean",
            old_logprobs_from_forward=update.on_policy_old_logprobs == "forward" and update.on_policy,
            needs_entropy=algorithm.needs_entropy(),
        )


@dataclass(frozen=True)
class StepPlan:
    """One step's shape. ``scoring_pass``: a no-grad pass scores the batch before any update (else the update's
    first forward gives the rollout policy's statistics, and the gate and selection are telemetry only);
    ``token_selection``: STARE's selection (``step/selection.py``); ``gate_aggregation``: how the entropy STARE's
    gate reads is aggregated; ``loss``: what each micro-batch's loss reads."""

    scoring_pass: bool
    token_selection: TokenSelection
    gate_aggregation: str  # an aggregation mode of ``aggregate_loss``
    loss: LossPlan
    collection: CollectionConfig
    advantage: AdvantageConfig
    balanced: bool  # the reference trainer's balancing (step/partition.py): rows dealt to ranks by workload,
    # mini-batches taken in that order, balanced micro-batches; else each rank's own rows, shuffled mini-batches,
    # consecutive micro-batches
    ppo_epochs: int
    mini_batches: int
    max_response_length: int
    forward: ForwardPlan

    @classmethod
    def resolve(cls, algorithm: AlgorithmConfig, rollout: RolloutConfig, forward: ForwardConfig) -> StepPlan:
        """The plan of a run with these validated config groups."""
        update = algorithm.update
        passes = ForwardPlan(
            temperature=rollout.temperature,
            chunk_size=forward.logprob_chunk_size,
            micro_batch_tokens=forward.micro_batch_tokens,
            layout=forward.layout(),
        )
        return cls(
            scoring_pass=algorithm.needs_scoring_pass(),
            token_selection=TokenSelection.resolve(algorithm.stare, group_size=rollout.n),
            gate_aggregation=algorithm.gate_loss_agg(),
            loss=LossPlan.resolve(algorithm),
            collection=algorithm.collection,
            advantage=algorithm.advantage,
            balanced=update.micro_batch_partition == "balanced",
            ppo_epochs=update.ppo_epochs,
            mini_batches=update.mini_batches,
            max_response_length=rollout.max_new_tokens,
            forward=passes,
        )

    @property
    def selection(self) -> SelectionTiming:
        """When the applied selection is made."""
        return self.token_selection.timing

    @property
    def reselect(self) -> bool:
        """The selection is made again before every optimizer step after the first."""
        return self.token_selection.reselect

    def pass_options(self) -> dict:
        """The keyword arguments of the no-grad passes over the step's batch (``score_batch`` and its kin)."""
        forward = self.forward
        return {
            "temperature": forward.temperature,
            "chunk_size": forward.chunk_size,
            "micro_batch_tokens": forward.micro_batch_tokens,
            "layout": forward.layout,
        }
