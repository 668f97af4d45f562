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

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from stare_lightning.algorithms.config_groups import (
    AdvantageConfig,
    ClipCovSettings,
    CollectionConfig,
    EntropyBonusConfig,
    EntropyControlConfig,
    KLConfig,
    KLCovSettings,
    MismatchConfig,
    PolicyLossConfig,
    TopEntropySettings,
    UpdateConfig,
    built_sub_groups,
    implementation,
    registered,
)
from stare_lightning.config.checks import choice, flag, number, text

if TYPE_CHECKING:
    from stare_lightning.algorithms.stare import STARERule
    from stare_lightning.algorithms.stare_controller import STAREController


def _stare():
    return implementation("stare")


def _selectors():
    return implementation("selectors").STARE_SELECTORS


def _controller():
    return implementation("stare_controller")


# Every class of the algorithm schema, config_groups.py's sub-groups included (re-exported on purpose: one module).
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
GATE_AGGREGATIONS = ("token-mean", "like_loss")  # the entropy the gate compares to its target


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
    """The gate opens on steps whose batch entropy (nats) is below this target (the start of a target schedule)."""
    target_schedule: str = "constant"
    """How the target moves over the steps: constant (`target_entropy` throughout), or linear or cosine from
    `target_entropy` to `target_end` over `target_horizon` steps, then held."""
    target_end: float | None = None
    """The target a linear or cosine schedule reaches at `target_horizon` (nats); null with `constant`."""
    target_horizon: int | None = None
    """Steps over which a linear or cosine schedule moves the target; null with `constant`."""
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
        registered(self, p, "variant", lambda: _stare().STARE_VARIANTS)
        number(f"{p}top_ratio", self.top_ratio, low=0.0, high=1.0)
        number(f"{p}w", self.w, low=0.0, low_open=True)
        number(f"{p}m", self.m, low=0.0, low_open=True)
        number(f"{p}target_entropy", self.target_entropy, low=0.0)
        registered(self, p, "selector", lambda: _selectors().names())
        registered(self, p, "scope", lambda: _stare().STARE_SCOPES)
        choice(f"{p}surprisal_source", self.surprisal_source, SURPRISAL_SOURCES)
        number(f"{p}alpha", self.alpha, low=0.0)
        number(f"{p}w_max", self.w_max, low=1.0)
        number(f"{p}m_min", self.m_min, low=0.0, high=1.0, low_open=True)
        registered(self, p, "timing", lambda: _controller().STARE_TIMINGS)
        choice(f"{p}k_rounding", self.k_rounding, ("ceil", "reference"))
        choice(f"{p}tie_order", self.tie_order, ("position", "topk"))
        flag(f"{p}gate_starts_open", self.gate_starts_open)
        choice(f"{p}gate_aggregation", self.gate_aggregation, GATE_AGGREGATIONS)
        self._check_target_schedule(p)
        if self.adaptive:
            number(f"{p}w", self.w, low=1.0, high=self.w_max)
            number(f"{p}m", self.m, low=self.m_min, high=1.0)

    def _check_target_schedule(self, p: str) -> None:
        registered(self, p, "target_schedule", lambda: _controller().TARGET_SCHEDULES)
        if self.target_schedule == "constant":
            for key in ("target_end", "target_horizon"):
                if getattr(self, key) is not None:
                    raise ValueError(
                        f"{p}{key}={getattr(self, key)!r} does nothing with {p}target_schedule=constant: set "
                        f"{p}target_schedule=linear or cosine, or {p}{key}=null"
                    )
            return
        for key in ("target_end", "target_horizon"):
            if getattr(self, key) is None:
                raise ValueError(
                    f"{p}{key} is required with {p}target_schedule={self.target_schedule}: the schedule moves the "
                    f"target from {p}target_entropy to {p}target_end over {p}target_horizon steps"
                )
        number(f"{p}target_end", self.target_end, low=0.0)
        number(f"{p}target_horizon", self.target_horizon, low=1, integer=True)

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
            target_schedule=self.target_schedule,
            target_end=self.target_end,
            target_horizon=self.target_horizon,
        )

    def rule(self) -> STARERule:
        """The selection's rule: the variant, P, the selector and the ranking's conventions (its W, M and gate are
        set per step)."""
        from stare_lightning.algorithms.stare import STARERule

        return STARERule(
            variant=self.variant,
            top_ratio=self.top_ratio,
            selector=self.selector,
            k_rounding=self.k_rounding,
            tie_order=self.tie_order,
        )

    def needs_sensitivity(self) -> bool:
        """Whether the logits pass must also return sum pi^2 and sum pi^2 log pi."""
        return self.enabled and _selectors()[self.selector].needs_phi


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
        built_sub_groups(self, "algorithm.")
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
        uses_pi = self.entropy_control.name == "pi"
        return (not self.update.on_policy) or self.stare.enabled or self.entropy_bonus.adaptive or uses_pi

    def needs_entropy(self) -> bool:
        """Whether the loss itself needs the per-token entropy with gradient (bonus or 80/20 rule)."""
        return self.entropy_bonus.enabled or self.entropy_control.name == "top_entropy"
