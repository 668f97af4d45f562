"""Typed, validated settings of the policy loss: the GRPO family, its entropy-control baselines and STARE.

What it implements: the `algorithm` config group's schema, one typed sub-group per part of the loss (advantage,
policy_loss, kl, entropy_bonus, entropy_control with a settings node per entry, collection, update, mismatch,
stare); keys of the former flat schema are refused with their new place (`config/moved_keys.py`). Defaults
follow docs/method.md (STARE: Luo et al. 2026, arXiv 2606.19236; O1, P = 0.1, W = 1.1, M = 0.9, H_tgt = 0.3,
adaptive off).
Only types OmegaConf supports appear (str, int, float, bool, Optional, nested dataclasses), so the
classes serve as Hydra structured schemas. OmegaConf does not run `__post_init__` on merges: call
`OmegaConf.to_object(cfg)` (which builds the dataclasses) to validate a composed config. Every scalar
the loss functions take (clip ranges, ratios, coefficients, the IS cap) is range-checked here and only
here: the functions in surrogates.py, entropy_control.py and rollout_correction.py check shapes only.

Departure from the paper: none; the choices the paper leaves open (selection scope, surprisal
source, timing of the adaptive schedule) are settings here, with the project's defaults.
"""

from __future__ import annotations

import importlib
from dataclasses import MISSING, dataclass, field, fields
from typing import TYPE_CHECKING

from stare_lightning.config.checks import choice, flag, number, registered_choice, text

if TYPE_CHECKING:
    from stare_lightning.algorithms.entropy_control import AdaptiveEntropyCoefficient
    from stare_lightning.algorithms.stare_controller import STAREController


def _module(name: str):
    """An implementation module of this package, imported when a choice must be looked up in it (never when this
    schema is imported or built with its defaults: reading the run's schema loads no torch)."""
    return importlib.import_module(f"stare_lightning.algorithms.{name}")


def _stare():
    return _module("stare")


def _selectors():
    return _module("selectors").STARE_SELECTORS


def _controller():
    return _module("stare_controller")


def _registered(config, prefix: str, name: str, names) -> None:
    """``registered_choice`` of field ``name`` of ``config``, against the schema's default for it."""
    default = next(f.default for f in fields(config) if f.name == name)
    registered_choice(f"{prefix}{name}", getattr(config, name), default=default, names=names)


__all__ = [
    "SURPRISAL_SOURCES",
    "AdvantageConfig",
    "AlgorithmConfig",
    "ClipCovSettings",
    "CollectionConfig",
    "EntropyBonusConfig",
    "EntropyControlConfig",
    "KLConfig",
    "KLCovSettings",
    "MismatchConfig",
    "PolicyLossConfig",
    "STAREConfig",
    "TopEntropySettings",
    "UpdateConfig",
]

SURPRISAL_SOURCES = ("current", "old")
# Where this project and the reference trainer part ways (docs/guides/semantics.md): one switch per point, the
# project's choice first. The `*_official` algorithm recipes set the reference trainer's side of each.
DYNAMIC_SAMPLING_METRICS = ("reward", "score")  # filter groups on the shaped reward, or the verifier's raw score
BUDGET_EXHAUSTED = ("train", "stop")  # dynamic sampling out of generation batches: train on what was kept, or stop
GATE_AGGREGATIONS = ("token-mean", "like_loss")  # the entropy the gate compares to its target
LOSS_NORMALIZERS = ("step", "micro_batch")  # token-mean over the step's tokens, or per micro-batch (reference)
OLD_LOGPROB_SOURCES = ("scoring_pass", "forward")  # on-policy: the no-grad pass, or the update's forward, detached
MICRO_BATCH_PARTITIONS = ("consecutive", "balanced")  # rows up to the token budget, or the reference's balanced split


@dataclass
class STAREConfig:
    """STARE settings (docs/method.md, sections 3 and 4)."""

    enabled: bool = False
    """Reweight the advantages of STARE's selected tokens while the gate is open."""
    variant: str = "O1"
    """O1: W on L+ only; C2: W on L+ and M on L-."""
    top_ratio: float = 0.1
    """P: the share of each sign set (T+, T-) that is selected, by surprisal."""
    w: float = 1.1
    """W: the weight of L+ tokens (positive advantage, most surprising) while the gate is open."""
    m: float = 0.9
    """M: the weight of L- tokens (negative advantage, most surprising) in C2 while the gate is open."""
    target_entropy: float = 0.3
    """The gate opens on steps whose batch entropy (nats) is below this target."""
    selector: str = "surprisal"
    """What ranks the tokens (`algorithms/selectors/`): surprisal, the exact entropy sensitivity Phi (`sensitivity`),
    the predictive entropy (`entropy`), or a seeded uniform draw of the same count (`random`, the control)."""
    scope: str = "step"
    """The pool a selection ranks: the step's whole batch, each micro-batch, sequence or group."""
    surprisal_source: str = "current"
    """Rank by the current policy's log-probs, or once per batch by the scoring pass's (`old`)."""
    adaptive: bool = False
    """Move W up and M down by `alpha` per step while the entropy is under target, and back above it."""
    alpha: float = 0.01
    """Step of the adaptive schedule."""
    w_max: float = 1.5
    """Upper bound of W under the adaptive schedule."""
    m_min: float = 0.5
    """Lower bound of M under the adaptive schedule."""
    timing: str = "next_step"
    """When an adaptive update applies: the next step (the paper) or the same step (reference code)."""
    k_rounding: str = "ceil"
    """k of a top-P set of n tokens: `ceil` (ceil(P n)) or `reference` (int(P n + 0.999999))."""
    tie_order: str = "position"
    """Exact surprisal ties: the earlier token wins (`position`) or torch.topk's order (`topk`)."""
    gate_starts_open: bool = False
    """The gate before the first entropy measurement (the reference code starts open)."""
    gate_aggregation: str = "token-mean"
    """The entropy the gate reads: the token mean, or aggregated like the loss (`like_loss`, the reference code)."""

    def __post_init__(self) -> None:
        p = "algorithm.stare."
        flag(f"{p}enabled", self.enabled)
        flag(f"{p}adaptive", self.adaptive)
        _registered(self, p, "variant", lambda: _stare().STARE_VARIANTS)
        number(f"{p}top_ratio", self.top_ratio, low=0.0, high=1.0)
        number(f"{p}w", self.w, low=0.0, low_open=True)
        number(f"{p}m", self.m, low=0.0, low_open=True)
        number(f"{p}target_entropy", self.target_entropy, low=0.0)
        _registered(self, p, "selector", lambda: _selectors().names())
        _registered(self, p, "scope", lambda: _stare().STARE_SCOPES)
        choice(f"{p}surprisal_source", self.surprisal_source, SURPRISAL_SOURCES)
        number(f"{p}alpha", self.alpha, low=0.0)
        number(f"{p}w_max", self.w_max, low=1.0)
        number(f"{p}m_min", self.m_min, low=0.0, high=1.0, low_open=True)
        _registered(self, p, "timing", lambda: _controller().STARE_TIMINGS)
        choice(f"{p}k_rounding", self.k_rounding, ("ceil", "reference"))
        choice(f"{p}tie_order", self.tie_order, ("position", "topk"))
        flag(f"{p}gate_starts_open", self.gate_starts_open)
        choice(f"{p}gate_aggregation", self.gate_aggregation, GATE_AGGREGATIONS)
        if self.adaptive:
            number(f"{p}w", self.w, low=1.0, high=self.w_max)
            number(f"{p}m", self.m, low=self.m_min, high=1.0)

    def make_controller(self) -> STAREController:
        """A fresh controller with these settings."""
        from stare_lightning.algorithms.stare_controller import STAREController

        return STAREController(
            target_entropy=self.target_entropy,
            w=self.w,
            m=self.m,
            adaptive=self.adaptive,
            alpha=self.alpha,
            w_max=self.w_max,
            m_min=self.m_min,
            timing=self.timing,
            gate_starts_open=self.gate_starts_open,
        )

    def needs_sensitivity(self) -> bool:
        """Whether the logits pass must also return sum pi^2 and sum pi^2 log pi."""
        return self.enabled and _selectors()[self.selector].needs_phi


@dataclass
class AdvantageConfig:
    """``algorithm.advantage``: the group advantage estimator (``algorithms/advantages.py``) and its settings."""

    name: str = "grpo"
    """The estimator (`algorithms/advantages.py`): grpo (group-standardised), dr_grpo (group-centred), rloo."""
    eps: float = 1e-6
    """Added to the group's reward std in GRPO's advantage."""

    def __post_init__(self) -> None:
        p = "algorithm.advantage."
        _registered(self, p, "name", lambda: _module("advantages").ADVANTAGE_ESTIMATORS.names())
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
        _registered(self, p, "name", lambda: _module("policy_losses").POLICY_LOSSES.names())
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
        _registered(self, p, "estimator", lambda: _module("surrogates").KL_ESTIMATORS)


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
    ``name``; each entry reads its own settings node (``clip_cov``, ``kl_cov``, ``top_entropy``)."""

    name: str = "none"
    """none, clip_cov, kl_cov or top_entropy."""
    clip_cov: ClipCovSettings = field(default_factory=ClipCovSettings)
    """Clip-Cov's settings."""
    kl_cov: KLCovSettings = field(default_factory=KLCovSettings)
    """KL-Cov's settings."""
    top_entropy: TopEntropySettings = field(default_factory=TopEntropySettings)
    """The 80/20 rule's settings."""

    def __post_init__(self) -> None:
        _nested(self, "algorithm.entropy_control.")
        _registered(
            self, "algorithm.entropy_control.", "name", lambda: _module("entropy_control").ENTROPY_CONTROLS.names()
        )

    def settings(self):
        """The settings node of the chosen entry (None for ``none``)."""
        return getattr(self, self.name, None)


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
        _registered(self, p, "loss_agg", lambda: _module("surrogates").AGGREGATION_MODES)
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
        _registered(self, p, "correction", lambda: ("none", *_module("rollout_correction").MISMATCH_LEVELS))
        _registered(self, p, "mode", lambda: _module("rollout_correction").MISMATCH_MODES)
        number(f"{p}cap", self.cap, low=0.0, low_open=True)

    @property
    def enabled(self) -> bool:
        return self.correction != "none"


def _nested(config, prefix: str) -> None:
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


@dataclass
class AlgorithmConfig:
    """The policy-loss settings, one sub-group per part; `name` is a free label for logs and run names."""

    name: str = "grpo"
    """A free label for logs, run names and the summary's title."""
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    """The group advantage estimator."""
    policy_loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    """The surrogate and its clip."""
    kl: KLConfig = field(default_factory=KLConfig)
    """The KL penalty to a frozen reference model."""
    entropy_bonus: EntropyBonusConfig = field(default_factory=EntropyBonusConfig)
    """An entropy term in the loss."""
    entropy_control: EntropyControlConfig = field(default_factory=EntropyControlConfig)
    """An entropy-control baseline and its settings."""
    collection: CollectionConfig = field(default_factory=CollectionConfig)
    """Dynamic sampling and the overlong penalty."""
    update: UpdateConfig = field(default_factory=UpdateConfig)
    """Optimizer steps per rollout batch and the loss's reduction."""
    mismatch: MismatchConfig = field(default_factory=MismatchConfig)
    """The rollout engine / trainer mismatch correction."""
    stare: STAREConfig = field(default_factory=STAREConfig)
    """STARE's settings (off unless `algorithm.stare.enabled`)."""

    def __post_init__(self) -> None:
        _nested(self, "algorithm.")
        text("algorithm.name", self.name)
        self._check_combinations()

    def _check_combinations(self) -> None:
        """What one sub-group's setting means for another's, refused where it would break or change nothing."""
        p = "algorithm."
        control = self.entropy_control.name
        if control in ("clip_cov", "kl_cov") and self.policy_loss.name != "ppo":
            raise ValueError(
                f"{p}entropy_control.name={control} is defined on PPO's token clip, not on "
                f"{p}policy_loss.name={self.policy_loss.name}: use policy_loss ppo, or entropy_control none or "
                "top_entropy"
            )
        if self.update.micro_batch_partition == "balanced" and self.stare.enabled and self.stare.scope == "group":
            raise ValueError(
                f"{p}stare.scope=group is not offered with {p}update.micro_batch_partition=balanced: balancing deals "
                "the step's rows to ranks by workload, so a group's rows are no longer consecutive on one rank; use "
                "scope micro_batch (the reference code's), step or sequence"
            )

    # Derived quantities.
    def gate_loss_agg(self) -> str:
        """The aggregation of the entropy that drives STARE's gate: the token mean (the paper), or the loss's
        (the reference code)."""
        return self.update.loss_agg if self.stare.gate_aggregation == "like_loss" else "token-mean"

    def uses_reference(self) -> bool:
        """Whether a frozen reference policy is needed (KL penalty on)."""
        return self.kl.coef > 0

    def needs_scoring_pass(self) -> bool:
        """Whether the rollout policy's token statistics are needed before the first loss: the old log-probs when
        the policy moves within a rollout batch (several epochs or mini-batches), STARE's gate (the step's batch
        entropy, and with scope ``step`` the whole batch's surprisal, before the first micro-batch's loss), the
        adaptive entropy coefficient. Otherwise the update's first forward provides them."""
        return (not self.update.on_policy) or self.stare.enabled or self.entropy_bonus.adaptive

    def needs_entropy(self) -> bool:
        """Whether the loss itself needs the per-token entropy with gradient (bonus or 80/20 rule)."""
        return self.entropy_bonus.enabled or self.entropy_control.name == "top_entropy"
