"""The sub-groups of the ``algorithm`` schema, one per part of the loss: ``advantage``, ``policy_loss``, ``kl``,
``entropy_bonus``, ``entropy_control`` (a settings node per entry), ``collection``, ``update`` and ``mismatch``.
``config.py`` assembles them with STARE's settings into ``AlgorithmConfig`` and checks what spans sub-groups.

Every scalar a loss function takes is range-checked here, by the sub-group that holds it; the functions check
shapes only. Like the rest of the schema, nothing here imports an implementation unless a non-default choice has
to be looked up in its registry.
"""

from __future__ import annotations

import importlib
from dataclasses import MISSING, dataclass, field, fields
from typing import TYPE_CHECKING

from stare_lightning.algorithms.config_controllers import PIControlSettings
from stare_lightning.config.checks import choice, flag, number, registered_choice

if TYPE_CHECKING:
    from stare_lightning.algorithms.entropy_control import AdaptiveEntropyCoefficient

__all__ = [
    "AdvantageConfig",
    "ClipCovSettings",
    "CollectionConfig",
    "EntropyBonusConfig",
    "EntropyControlConfig",
    "KLConfig",
    "KLCovSettings",
    "MismatchConfig",
    "PolicyLossConfig",
    "TopEntropySettings",
    "UpdateConfig",
    "built_sub_groups",
    "implementation",
    "registered",
]

# Where this project and the reference trainer part ways (docs/guides/semantics.md): one switch per point, the
# project's choice first. The `*_official` algorithm recipes set the reference trainer's side of each.
DYNAMIC_SAMPLING_METRICS = ("reward", "score")  # filter groups on the shaped reward, or the verifier's raw score
BUDGET_EXHAUSTED = ("train", "stop")  # dynamic sampling out of generation batches: train on what was kept, or stop
LOSS_NORMALIZERS = ("step", "micro_batch")  # token-mean over the step's tokens, or per micro-batch (reference)
OLD_LOGPROB_SOURCES = ("scoring_pass", "forward")  # on-policy: the no-grad pass, or the update's forward, detached
MICRO_BATCH_PARTITIONS = ("consecutive", "balanced")  # rows up to the token budget, or the reference's balanced split


def implementation(name: str):
    """An implementation module of this package, imported when a choice must be looked up in it (never when the
    schema is imported or built with its defaults: reading the run's schema loads no torch)."""
    return importlib.import_module(f"stare_lightning.algorithms.{name}")


def registered(config, prefix: str, name: str, names) -> None:
    """``registered_choice`` of field ``name`` of ``config``, against the schema's default for it."""
    default = next(f.default for f in fields(config) if f.name == name)
    registered_choice(f"{prefix}{name}", getattr(config, name), default=default, names=names)


# Each sub-group reads like every schema (rollout/, trainer/ ...): a key and its docstring, the help config_reference.py
# shows for it; runs of such fields look alike across the schemas on purpose.
@dataclass
class AdvantageConfig:
    """``algorithm.advantage``: the group advantage estimator (``algorithms/advantages.py``) and its settings."""

    name: str = "grpo"
    """The estimator (`algorithms/advantages.py`): grpo (group-standardised), dr_grpo (group-centred), rloo."""
    eps: float = 1e-6
    """Added to the group's reward std in GRPO's advantage."""

    def __post_init__(self) -> None:
        p = "algorithm.advantage."
        registered(self, p, "name", lambda: implementation("advantages").ADVANTAGE_ESTIMATORS.names())
        number(f"{p}eps", self.eps, low=0.0)


@dataclass
class PolicyLossConfig:
    """``algorithm.policy_loss``: the surrogate (``algorithms/policy_losses.py``) and its clip."""

    name: str = "ppo"
    """PPO's token clip, GSPO's sequence ratio or CISPO's clipped IS weight."""
    clip_eps_low: float = 0.2
    """Lower clip range: the ratio is clipped at 1 - clip_eps_low."""
    clip_eps_high: float = 0.2
    """Upper clip range: the ratio is clipped at 1 + clip_eps_high (DAPO's clip-higher: 0.28)."""
    dual_clip_c: float | None = None
    """Dual clip: bounds the loss of negative-advantage tokens at -A c (PPO only); null: off."""

    def __post_init__(self) -> None:
        p = "algorithm.policy_loss."
        registered(self, p, "name", lambda: implementation("policy_losses").POLICY_LOSSES.names())
        number(f"{p}clip_eps_low", self.clip_eps_low, low=0.0, high=1.0)
        number(f"{p}clip_eps_high", self.clip_eps_high, low=0.0)
        if self.dual_clip_c is None:
            return
        number(f"{p}dual_clip_c", self.dual_clip_c, low=1.0, low_open=True)
        if self.name != "ppo":
            raise ValueError(
                f"{p}dual_clip_c={self.dual_clip_c} does nothing with {p}name={self.name}: the dual clip bounds "
                f"PPO's token ratio; set {p}dual_clip_c=null"
            )


@dataclass
class KLConfig:
    """``algorithm.kl``: the penalty to a frozen reference model."""

    coef: float = 0.0
    """Weight of the KL penalty (0: no reference model is loaded)."""
    estimator: str = "k3"
    """Schulman's estimator of the KL term (k1, k2, k3, ...)."""

    def __post_init__(self) -> None:
        p = "algorithm.kl."
        number(f"{p}coef", self.coef, low=0.0)
        registered(self, p, "estimator", lambda: implementation("surrogates").KL_ESTIMATORS)


@dataclass
class EntropyBonusConfig:
    """``algorithm.entropy_bonus``: an entropy term in the loss, fixed or adapted toward a target entropy."""

    coef: float = 0.0
    """The bonus coefficient (the starting one when `target` is set)."""
    target: float | None = None
    """Set: the coefficient adapts toward this batch entropy (nats); null: fixed."""
    coef_lr: float = 0.01
    """Step of the adaptive coefficient."""
    coef_max: float = 0.1
    """Upper bound of the adaptive coefficient."""

    def __post_init__(self) -> None:
        p = "algorithm.entropy_bonus."
        number(f"{p}coef", self.coef, low=0.0)
        if self.target is not None:
            number(f"{p}target", self.target, low=0.0)
        number(f"{p}coef_lr", self.coef_lr, low=0.0)
        number(f"{p}coef_max", self.coef_max, low=0.0)
        if self.target is not None and self.coef > self.coef_max:
            raise ValueError(
                f"{p}coef={self.coef!r} is out of range: with {p}target set it must be <= coef_max={self.coef_max}"
            )

    @property
    def enabled(self) -> bool:
        return self.coef > 0 or self.target is not None

    @property
    def adaptive(self) -> bool:
        return self.target is not None

    def make_coefficient(self) -> AdaptiveEntropyCoefficient | None:
        """The adaptive coefficient when ``target`` is set, else None (a fixed coefficient)."""
        if self.target is None:
            return None
        from stare_lightning.algorithms.entropy_control import AdaptiveEntropyCoefficient

        return AdaptiveEntropyCoefficient(
            target=self.target, init_coef=self.coef, lr=self.coef_lr, max_coef=self.coef_max
        )


@dataclass
class ClipCovSettings:
    """Clip-Cov (Cui et al. 2025): detach the gradient of a few tokens of high covariance."""

    ratio: float = 2e-4
    """Share of tokens whose gradient is detached."""
    lb: float = 1.0
    """Lower covariance bound of the candidate tokens."""
    ub: float = 5.0
    """Upper covariance bound of the candidate tokens."""

    def __post_init__(self) -> None:
        p = "algorithm.entropy_control.clip_cov."
        number(f"{p}ratio", self.ratio, low=0.0, high=1.0, low_open=True)
        number(f"{p}lb", self.lb)
        number(f"{p}ub", self.ub)
        if not self.lb < self.ub:
            raise ValueError(f"{p}ub={self.ub!r} is out of range: must be > {p}lb={self.lb}")


@dataclass
class KLCovSettings:
    """KL-Cov (Cui et al. 2025): a |log pi - log pi_old| penalty on the tokens of highest covariance."""

    ratio: float = 2e-3
    """Share of tokens, highest covariance first, that get the penalty."""
    coef: float = 1.0
    """Weight of the penalty."""

    def __post_init__(self) -> None:
        p = "algorithm.entropy_control.kl_cov."
        number(f"{p}ratio", self.ratio, low=0.0, high=1.0, low_open=True)
        number(f"{p}coef", self.coef, low=0.0)


@dataclass
class TopEntropySettings:
    """The 80/20 rule (Wang et al. 2025): only the highest-entropy tokens keep their gradient."""

    fraction: float = 0.2
    """Share of tokens, highest entropy first, that keep their gradient."""

    def __post_init__(self) -> None:
        number("algorithm.entropy_control.top_entropy.fraction", self.fraction, low=0.0, high=1.0, low_open=True)


@dataclass
class EntropyControlConfig:
    """``algorithm.entropy_control``: an entropy-control baseline (``algorithms/entropy_control.py``), named by
    ``name``; each entry reads its own settings node (``clip_cov``, ``kl_cov``, ``top_entropy``, ``pi``)."""

    name: str = "none"
    """none, clip_cov, kl_cov, top_entropy, or pi (a PI controller on the weights of positive and negative
    samples, EntroPIC's style)."""
    clip_cov: ClipCovSettings = field(default_factory=ClipCovSettings)
    """Clip-Cov's settings."""
    kl_cov: KLCovSettings = field(default_factory=KLCovSettings)
    """KL-Cov's settings."""
    top_entropy: TopEntropySettings = field(default_factory=TopEntropySettings)
    """The 80/20 rule's settings."""
    pi: PIControlSettings = field(default_factory=PIControlSettings)
    """The PI controller's settings."""

    def __post_init__(self) -> None:
        built_sub_groups(self, "algorithm.entropy_control.")
        registered(
            self,
            "algorithm.entropy_control.",
            "name",
            lambda: implementation("entropy_control").ENTROPY_CONTROLS.names(),
        )

    def settings(self):
        """The settings node of the chosen entry (None for ``none``)."""
        return getattr(self, self.name, None)

    def make_step_controller(self):
        """The step controller of the chosen entry (the PI controller for ``pi``), else None: the other entries act
        per micro-batch and keep no state."""
        return self.pi.make_controller() if self.name == "pi" else None


@dataclass
class CollectionConfig:
    """``algorithm.collection``: how a step's rollouts are gathered and shaped before the loss (``step/collect.py``):
    DAPO's dynamic sampling and overlong penalty."""

    dynamic_sampling: bool = False
    """Drop groups whose rewards all agree and sample more prompts to refill the step (DAPO)."""
    max_generation_batches: int = 10
    """Dynamic sampling: generation rounds per step at most."""
    generation_batch_multiplier: int = 1
    """Dynamic sampling: prompts generated per round, in step batches."""
    dynamic_sampling_metric: str = "reward"
    """What must vary within a group: the shaped reward, or the verifier's raw score."""
    budget_exhausted: str = "train"
    """`max_generation_batches` reached with the step still short: train on what was kept, or stop."""
    overlong_buffer: int = 0
    """DAPO's soft overlong penalty over the last this many tokens of `rollout.max_new_tokens` (0: off)."""
    overlong_penalty_factor: float = 1.0
    """The overlong penalty at `rollout.max_new_tokens`."""

    def __post_init__(self) -> None:
        p = "algorithm.collection."
        flag(f"{p}dynamic_sampling", self.dynamic_sampling)
        number(f"{p}max_generation_batches", self.max_generation_batches, low=1, integer=True)
        number(f"{p}generation_batch_multiplier", self.generation_batch_multiplier, low=1, integer=True)
        choice(f"{p}dynamic_sampling_metric", self.dynamic_sampling_metric, DYNAMIC_SAMPLING_METRICS)
        choice(f"{p}budget_exhausted", self.budget_exhausted, BUDGET_EXHAUSTED)
        number(f"{p}overlong_buffer", self.overlong_buffer, low=0, integer=True)
        number(f"{p}overlong_penalty_factor", self.overlong_penalty_factor, low=0.0)
        if self.generation_batch_multiplier > 1 and not self.dynamic_sampling:
            raise ValueError(
                f"{p}generation_batch_multiplier={self.generation_batch_multiplier} does nothing without "
                f"dynamic sampling: set {p}dynamic_sampling=true or leave the multiplier at 1"
            )
        if self.budget_exhausted != "train" and not self.dynamic_sampling:
            raise ValueError(
                f"{p}budget_exhausted={self.budget_exhausted!r} does nothing without dynamic sampling: set "
                f"{p}dynamic_sampling=true or {p}budget_exhausted=train"
            )


@dataclass
class UpdateConfig:
    """``algorithm.update``: the optimizer steps one rollout batch feeds, and how their token losses reduce."""

    ppo_epochs: int = 1
    """Passes over each rollout batch."""
    mini_batches: int = 1
    """Optimizer steps per pass (the global batch split into this many mini-batches)."""
    loss_agg: str = "token-mean"
    """How token losses aggregate over the step (`algorithms/surrogates.py`); the KL and entropy terms follow it."""
    loss_normalizer: str = "step"
    """The token mean's denominator: the step's tokens, or each micro-batch's (reference code)."""
    on_policy_old_logprobs: str = "scoring_pass"
    """Old log-probs of an on-policy step: the no-grad scoring pass, or the update's forward, detached."""
    micro_batch_partition: str = "consecutive"
    """Which rows train together: consecutive rows up to the token budget, or the reference code's balanced split."""

    def __post_init__(self) -> None:
        p = "algorithm.update."
        number(f"{p}ppo_epochs", self.ppo_epochs, low=1, integer=True)
        number(f"{p}mini_batches", self.mini_batches, low=1, integer=True)
        registered(self, p, "loss_agg", lambda: implementation("surrogates").AGGREGATION_MODES)
        choice(f"{p}loss_normalizer", self.loss_normalizer, LOSS_NORMALIZERS)
        choice(f"{p}on_policy_old_logprobs", self.on_policy_old_logprobs, OLD_LOGPROB_SOURCES)
        choice(f"{p}micro_batch_partition", self.micro_batch_partition, MICRO_BATCH_PARTITIONS)
        if self.loss_normalizer == "micro_batch" and self.loss_agg == "seq-mean-token-sum-norm":
            raise ValueError(
                f"{p}loss_normalizer=micro_batch is not offered with {p}loss_agg=seq-mean-token-sum-norm: the "
                "reference code scales that mode by its micro-batch row count; use token-mean or seq-mean-token-mean"
            )
        if self.on_policy_old_logprobs == "forward" and not self.on_policy:
            raise ValueError(
                f"{p}on_policy_old_logprobs=forward applies to on-policy steps only (ppo_epochs=1, mini_batches=1; "
                f"got {self.ppo_epochs}, {self.mini_batches}): the policy moves before later mini-batches, so "
                "their old log-probs must come from the scoring pass"
            )

    @property
    def on_policy(self) -> bool:
        """One gradient step per rollout batch: the old log-probs equal the current ones (detached)."""
        return self.ppo_epochs == 1 and self.mini_batches == 1


@dataclass
class MismatchConfig:
    """``algorithm.mismatch``: importance weights for the rollout engine / trainer mismatch
    (``algorithms/rollout_correction.py``)."""

    correction: str = "none"
    """none, or the level of the weight: per token or per sequence."""
    mode: str = "truncate"
    """Above `cap`: cap the weight (`truncate`) or zero it (`mask`)."""
    cap: float = 2.0
    """The cap of the importance weight."""

    def __post_init__(self) -> None:
        p = "algorithm.mismatch."
        registered(self, p, "correction", lambda: ("none", *implementation("rollout_correction").MISMATCH_LEVELS))
        registered(self, p, "mode", lambda: implementation("rollout_correction").MISMATCH_MODES)
        number(f"{p}cap", self.cap, low=0.0, low_open=True)

    @property
    def enabled(self) -> bool:
        return self.correction != "none"


def built_sub_groups(config, prefix: str) -> None:
    """Build each nested settings node of ``config`` given as a mapping (a plain dict, as tests and Python callers
    pass it), and refuse anything else with the key that holds it."""
    for f in fields(config):
        kind = f.default_factory if f.default_factory is not MISSING else None
        if not isinstance(kind, type):
            continue
        value = getattr(config, f.name)
        if isinstance(value, dict):
            setattr(config, f.name, kind(**value))
        elif not isinstance(value, kind):
            raise ValueError(f"{prefix}{f.name}={value!r} is not allowed: must be a mapping of {kind.__name__}'s keys")
