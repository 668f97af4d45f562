"""Typed, validated settings of the policy loss: the GRPO family, its entropy-control baselines and STARE.

What it implements: the `algorithm` config group's schema. Defaults follow docs/method.md
(STARE: Luo et al. 2026, arXiv 2606.19236; O1, P = 0.1, W = 1.1, M = 0.9, H_tgt = 0.3, adaptive off).
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
from dataclasses import dataclass, field, fields
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


__all__ = ["SURPRISAL_SOURCES", "AlgorithmConfig", "STAREConfig"]

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
class AlgorithmConfig:
    """The policy-loss settings; `name` is a free label for logs and run names."""

    name: str = "grpo"
    """A free label for logs, run names and the summary's title."""
    advantage: str = "grpo"
    """Group advantage estimator (`algorithms/advantages.py`)."""
    policy_loss: str = "ppo"
    """The surrogate: PPO's token clip, GSPO's sequence ratio or CISPO's clipped IS weight."""
    adv_eps: float = 1e-6
    """Added to the group's reward std in GRPO's advantage."""
    clip_eps_low: float = 0.2
    """Lower clip range: the ratio is clipped at 1 - clip_eps_low."""
    clip_eps_high: float = 0.2
    """Upper clip range: the ratio is clipped at 1 + clip_eps_high (DAPO's clip-higher: 0.28)."""
    dual_clip_c: float | None = None
    """Dual clip: bounds the loss of negative-advantage tokens at -A c (PPO only); null: off."""
    loss_agg: str = "token-mean"
    """How token losses aggregate over the step (`algorithms/surrogates.py`)."""
    kl_coef: float = 0.0
    """Weight of the KL penalty to a frozen reference model (0: no reference model is loaded)."""
    kl_estimator: str = "k3"
    """Schulman's estimator of the KL term."""
    entropy_coef: float = 0.0
    """Entropy bonus coefficient (the starting one when `entropy_target` is set)."""
    entropy_target: float | None = None
    """Set: the entropy coefficient adapts toward this batch entropy (nats); null: fixed."""
    entropy_coef_lr: float = 0.01
    """Step of the adaptive entropy coefficient."""
    entropy_coef_max: float = 0.1
    """Upper bound of the adaptive entropy coefficient."""
    entropy_control: str = "none"
    """An entropy-control baseline (`algorithms/entropy_control.py`)."""
    clip_cov_ratio: float = 2e-4
    """Clip-Cov: share of tokens whose gradient is detached."""
    clip_cov_lb: float = 1.0
    """Clip-Cov: lower covariance bound of the candidate tokens."""
    clip_cov_ub: float = 5.0
    """Clip-Cov: upper covariance bound of the candidate tokens."""
    kl_cov_ratio: float = 2e-3
    """KL-Cov: share of tokens, highest covariance first, that get the penalty."""
    kl_cov_coef: float = 1.0
    """KL-Cov: weight of the |log pi - log pi_old| penalty."""
    top_entropy_fraction: float = 0.2
    """The 80/20 rule: share of tokens, highest entropy first, that keep their gradient."""
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
    gate_aggregation: str = "token-mean"
    """The entropy STARE's gate reads: the token mean, or aggregated like the loss."""
    loss_normalizer: str = "step"
    """The token mean's denominator: the step's tokens, or each micro-batch's (reference code)."""
    on_policy_old_logprobs: str = "scoring_pass"
    """Old log-probs of an on-policy step: the no-grad scoring pass, or the update's forward, detached."""
    micro_batch_partition: str = "consecutive"
    """Which rows train together: consecutive rows up to the token budget, or the reference code's balanced split."""
    overlong_buffer: int = 0
    """DAPO's soft overlong penalty over the last this many tokens of `rollout.max_new_tokens` (0: off)."""
    overlong_penalty_factor: float = 1.0
    """The overlong penalty at `rollout.max_new_tokens`."""
    ppo_epochs: int = 1
    """Passes over each rollout batch."""
    mini_batches: int = 1
    """Optimizer steps per pass (the global batch split into this many mini-batches)."""
    mismatch_correction: str = "none"
    """Importance weights for the rollout engine/trainer mismatch, per token or per sequence."""
    mismatch_mode: str = "truncate"
    """Above `mismatch_cap`: cap the weight (`truncate`) or zero it (`mask`)."""
    mismatch_cap: float = 2.0
    """The cap of the mismatch importance weight."""
    stare: STAREConfig = field(default_factory=STAREConfig)
    """STARE's settings (off unless `algorithm.stare.enabled`)."""

    def __post_init__(self) -> None:
        if isinstance(self.stare, dict):
            self.stare = STAREConfig(**self.stare)
        if not isinstance(self.stare, STAREConfig):
            raise ValueError(
                f"algorithm.stare={self.stare!r} is not allowed: must be a STAREConfig or a mapping of its keys"
            )
        p = "algorithm."
        text(f"{p}name", self.name)
        _registered(self, p, "advantage", lambda: _module("advantages").ADVANTAGE_ESTIMATORS.names())
        _registered(self, p, "policy_loss", lambda: _module("policy_losses").POLICY_LOSSES.names())
        number(f"{p}adv_eps", self.adv_eps, low=0.0)
        number(f"{p}clip_eps_low", self.clip_eps_low, low=0.0, high=1.0)
        number(f"{p}clip_eps_high", self.clip_eps_high, low=0.0)
        if self.dual_clip_c is not None:
            number(f"{p}dual_clip_c", self.dual_clip_c, low=1.0, low_open=True)
        _registered(self, p, "loss_agg", lambda: _module("surrogates").AGGREGATION_MODES)
        number(f"{p}kl_coef", self.kl_coef, low=0.0)
        _registered(self, p, "kl_estimator", lambda: _module("surrogates").KL_ESTIMATORS)
        number(f"{p}entropy_coef", self.entropy_coef, low=0.0)
        if self.entropy_target is not None:
            number(f"{p}entropy_target", self.entropy_target, low=0.0)
        number(f"{p}entropy_coef_lr", self.entropy_coef_lr, low=0.0)
        number(f"{p}entropy_coef_max", self.entropy_coef_max, low=0.0)
        if self.entropy_target is not None and self.entropy_coef > self.entropy_coef_max:
            raise ValueError(
                f"{p}entropy_coef={self.entropy_coef!r} is out of range: with entropy_target set it must "
                f"be <= entropy_coef_max={self.entropy_coef_max}"
            )
        _registered(self, p, "entropy_control", lambda: _module("entropy_control").ENTROPY_CONTROLS.names())
        number(f"{p}clip_cov_ratio", self.clip_cov_ratio, low=0.0, high=1.0, low_open=True)
        number(f"{p}clip_cov_lb", self.clip_cov_lb)
        number(f"{p}clip_cov_ub", self.clip_cov_ub)
        if not self.clip_cov_lb < self.clip_cov_ub:
            raise ValueError(
                f"{p}clip_cov_ub={self.clip_cov_ub!r} is out of range: must be > clip_cov_lb={self.clip_cov_lb}"
            )
        number(f"{p}kl_cov_ratio", self.kl_cov_ratio, low=0.0, high=1.0, low_open=True)
        number(f"{p}kl_cov_coef", self.kl_cov_coef, low=0.0)
        number(f"{p}top_entropy_fraction", self.top_entropy_fraction, low=0.0, high=1.0, low_open=True)
        flag(f"{p}dynamic_sampling", self.dynamic_sampling)
        number(f"{p}max_generation_batches", self.max_generation_batches, low=1, integer=True)
        number(f"{p}generation_batch_multiplier", self.generation_batch_multiplier, low=1, integer=True)
        if self.generation_batch_multiplier > 1 and not self.dynamic_sampling:
            raise ValueError(
                f"{p}generation_batch_multiplier={self.generation_batch_multiplier} does nothing without "
                f"dynamic sampling: set {p}dynamic_sampling=true or leave the multiplier at 1"
            )
        self._check_semantics()
        self._check_policy_loss()
        number(f"{p}overlong_buffer", self.overlong_buffer, low=0, integer=True)
        number(f"{p}overlong_penalty_factor", self.overlong_penalty_factor, low=0.0)
        number(f"{p}ppo_epochs", self.ppo_epochs, low=1, integer=True)
        number(f"{p}mini_batches", self.mini_batches, low=1, integer=True)
        _registered(self, p, "mismatch_correction", lambda: ("none", *_module("rollout_correction").MISMATCH_LEVELS))
        _registered(self, p, "mismatch_mode", lambda: _module("rollout_correction").MISMATCH_MODES)
        number(f"{p}mismatch_cap", self.mismatch_cap, low=0.0, low_open=True)

    def _check_semantics(self) -> None:
        """The switches of the semantics table (docs/guides/semantics.md); each is refused where it would change
        nothing."""
        p = "algorithm."
        choice(f"{p}dynamic_sampling_metric", self.dynamic_sampling_metric, DYNAMIC_SAMPLING_METRICS)
        choice(f"{p}budget_exhausted", self.budget_exhausted, BUDGET_EXHAUSTED)
        choice(f"{p}gate_aggregation", self.gate_aggregation, GATE_AGGREGATIONS)
        choice(f"{p}loss_normalizer", self.loss_normalizer, LOSS_NORMALIZERS)
        choice(f"{p}on_policy_old_logprobs", self.on_policy_old_logprobs, OLD_LOGPROB_SOURCES)
        choice(f"{p}micro_batch_partition", self.micro_batch_partition, MICRO_BATCH_PARTITIONS)
        if self.micro_batch_partition == "balanced" and self.stare.enabled and self.stare.scope == "group":
            raise ValueError(
                f"{p}stare.scope=group is not offered with {p}micro_batch_partition=balanced: balancing deals the "
                "step's rows to ranks by workload, so a group's rows are no longer consecutive on one rank; use "
                "scope micro_batch (the reference code's), step or sequence"
            )
        if self.budget_exhausted != "train" and not self.dynamic_sampling:
            raise ValueError(
                f"{p}budget_exhausted={self.budget_exhausted!r} does nothing without dynamic sampling: set "
                f"{p}dynamic_sampling=true or {p}budget_exhausted=train"
            )
        if self.loss_normalizer == "micro_batch" and self.loss_agg == "seq-mean-token-sum-norm":
            raise ValueError(
                f"{p}loss_normalizer=micro_batch is not offered with {p}loss_agg=seq-mean-token-sum-norm: the "
                "reference code scales that mode by its micro-batch row count; use token-mean or seq-mean-token-mean"
            )
        if self.on_policy_old_logprobs == "forward" and not self.is_on_policy():
            raise ValueError(
                f"{p}on_policy_old_logprobs=forward applies to on-policy steps only (ppo_epochs=1, mini_batches=1; "
                f"got {self.ppo_epochs}, {self.mini_batches}): the policy moves before later mini-batches, so "
                "their old log-probs must come from the scoring pass"
            )

    def _check_policy_loss(self) -> None:
        """PPO's dual clip and the covariance controls are defined on PPO's token clip; the others have none."""
        p = "algorithm."
        if self.policy_loss == "ppo":
            return
        if self.dual_clip_c is not None:
            raise ValueError(
                f"{p}dual_clip_c={self.dual_clip_c} does nothing with {p}policy_loss={self.policy_loss}: the dual clip "
                f"bounds PPO's token ratio; set {p}dual_clip_c=null"
            )
        if self.entropy_control in ("clip_cov", "kl_cov"):
            raise ValueError(
                f"{p}entropy_control={self.entropy_control} is defined on PPO's token clip, not on "
                f"{p}policy_loss={self.policy_loss}: use policy_loss=ppo, or entropy_control none or top_entropy"
            )

    # Derived quantities.
    def gate_loss_agg(self) -> str:
        """The aggregation of the entropy that drives STARE's gate: the token mean (the paper), or the loss's
        (the reference code)."""
        return self.loss_agg if self.gate_aggregation == "like_loss" else "token-mean"

    def uses_reference(self) -> bool:
        """Whether a frozen reference policy is needed (KL penalty on)."""
        return self.kl_coef > 0

    def is_on_policy(self) -> bool:
        """One gradient step per rollout batch: the old log-probs equal the current ones (detached)."""
        return self.ppo_epochs == 1 and self.mini_batches == 1

    def needs_old_logprob_pass(self) -> bool:
        """Whether a no-grad logits pass over the whole step batch must precede the first loss.

        Needed when the policy moves within a rollout batch (several epochs or mini-batches), and
        for STARE, whose gate needs the step's batch entropy (and scope 'step' the whole batch's
        surprisal) before the first micro-batch's loss.
        """
        return (not self.is_on_policy()) or self.stare.enabled

    def needs_scoring_pass(self) -> bool:
        """Whether the rollout policy's token statistics are needed before the first loss (the old log-probs,
        STARE's gate, the adaptive entropy coefficient); otherwise the update's first forward provides them."""
        return self.needs_old_logprob_pass() or self.uses_adaptive_entropy_coef()

    def make_entropy_coefficient(self) -> AdaptiveEntropyCoefficient | None:
        """The adaptive entropy coefficient when ``entropy_target`` is set, else None (a fixed coefficient)."""
        if self.entropy_target is None:
            return None
        from stare_lightning.algorithms.entropy_control import AdaptiveEntropyCoefficient

        return AdaptiveEntropyCoefficient(
            target=self.entropy_target,
            init_coef=self.entropy_coef,
            lr=self.entropy_coef_lr,
            max_coef=self.entropy_coef_max,
        )

    def uses_entropy_bonus(self) -> bool:
        return self.entropy_coef > 0 or self.entropy_target is not None

    def uses_adaptive_entropy_coef(self) -> bool:
        return self.entropy_target is not None

    def needs_entropy(self) -> bool:
        """Whether the loss itself needs the per-token entropy with gradient (bonus or 80/20 rule)."""
        return self.uses_entropy_bonus() or self.entropy_control == "top_entropy"

    def uses_overlong_penalty(self) -> bool:
        return self.overlong_buffer > 0

    def uses_mismatch_correction(self) -> bool:
        """Whether the loss is weighted by importance ratios of the trainer's and the engine's log-probs."""
        return self.mismatch_correction != "none"
