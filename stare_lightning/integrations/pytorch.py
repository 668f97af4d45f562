"""STARE in any PyTorch training loop: the entropy gate, the controller's state and the token weights.

What it implements: STARE (Luo et al. 2026, arXiv 2606.19236; docs/method.md, section 3) for a loop this project
does not run. Once per training step, ``STARE.step`` takes the step's per-token log-probs and entropies (or the
logits and the sampled tokens), the advantages and the response mask; it measures the step's batch entropy H_k (the
token mean over every valid token of every rank), moves the controller (the gate H_k < target, the adaptive W and
M) and returns the weights omega that multiply the per-token policy loss after clipping, with the gate's decision
and this project's telemetry (``stare/*``, ``quadrant/*``). Everything is ``stare_lightning.algorithms``'s own:
``STAREController`` for the gate and W/M, ``STARERule`` and ``stare_weights_for_scope`` for the top-P selection per
advantage sign, ``token_stats_from_logits`` and ``entropy_sensitivity`` for the statistics, and
``metrics.stare_step`` for the telemetry. Nothing here imports Lightning, Hydra or omegaconf.

Where it departs from this project's trainer (``algorithm.stare.*``): the gate reads the token mean (the trainer's
``gate_aggregation=like_loss`` needs the loss's aggregation, which lives in the caller's loop); the log-probs given
are what ranks the tokens, so ``surprisal_source`` is the caller's choice (pass the current policy's, detached,
for the paper's ranking). With several optimizer steps per batch the trainer re-ranks by the updated policy
before each: call ``select`` with the new log-probs, which keeps the step's gate, W and M.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
from torch import Tensor

from stare_lightning.algorithms.config import STAREConfig
from stare_lightning.algorithms.sensitivity import entropy_sensitivity
from stare_lightning.algorithms.stare import STARERule, stare_weights_for_scope
from stare_lightning.algorithms.stare_controller import StepParams
from stare_lightning.algorithms.token_stats import token_stats_from_logits
from stare_lightning.metrics.stare_step import stare_step_metrics, token_mean_entropy

__all__ = ["STARE", "STAREResult", "STARESettings"]

# The settings of ``algorithm.stare`` that a caller's loop decides itself (module docstring).
_LOOP_OWNED = ("enabled", "surprisal_source", "gate_aggregation")


class _SettingsChecks:
    """What ``STARESettings`` adds to its fields: the check, the project's config and the selection's rule."""

    def __post_init__(self) -> None:
        try:
            self.as_config()
        except ValueError as error:
            raise ValueError(str(error).replace("algorithm.stare.", "STARESettings.")) from None

    def as_config(self) -> STAREConfig:
        """This project's ``algorithm.stare`` with these settings and STARE on (checks them)."""
        return STAREConfig(enabled=True, **dataclasses.asdict(self))

    def rule(self) -> STARERule:
        """The selection's rule (its W, M and gate are set per step)."""
        return self.as_config().rule()


# STARESettings has STAREConfig's fields and defaults, less those the loop owns: one list of fields, STAREConfig's.
STARESettings = dataclasses.make_dataclass(
    "STARESettings",
    [
        (f.name, f.type, dataclasses.field(default=f.default))
        for f in dataclasses.fields(STAREConfig)
        if f.name not in _LOOP_OWNED
    ],
    bases=(_SettingsChecks,),
    namespace={
        "__module__": __name__,
        "__doc__": """STARE's settings: the names and defaults of this project's ``algorithm.stare.*``
    (docs/method.md), built from ``STAREConfig``'s fields less ``enabled``, ``surprisal_source`` and
    ``gate_aggregation`` (the loop's own).

    variant: "O1" (W on L+) or "C2" (also M on L-); top_ratio: P, the share of each advantage sign selected;
    w, m: the weights while the gate is open; target_entropy: the gate opens on steps whose batch entropy is
    below it; selector: what ranks the tokens ("surprisal", "sensitivity", "entropy", "random"); scope: the
    pool one selection ranks ("step": every token given, gathered across ranks; "micro_batch": this rank's
    tokens only; "sequence": each row; "group": each block of ``group_size`` rows); adaptive, alpha, w_max,
    m_min: the adaptive schedule of W and M; timing: when an adaptive update applies ("next_step", the paper's,
    or "same_step"); k_rounding, tie_order: the ranking's conventions; gate_starts_open: the gate before the
    first measurement. Checked as ``algorithm.stare`` is; an error names the setting.
    """,
    },
)


@dataclass(frozen=True)
class STAREResult:
    """One step's STARE: ``weights`` [B, T] float32 (omega; all 1 when the gate is closed, and at masked positions),
    ``gate_on``, ``params`` (the gate, W and M this step uses, and the entropy the gate read), ``entropy`` (H_k),
    ``selected`` (bool [B, T]: L+ and L-, made even with the gate closed) and ``metrics`` under this project's
    names (``stare/gate_on``, ``stare/w``, ``stare/m``, ``stare/gate_entropy``, ``stare/selected_frac/pos|neg``,
    ``entropy``, and ``quadrant/{proxy,exact}/<quadrant>/{tokens,weight,dH}`` when Phi is known)."""

    weights: Tensor
    gate_on: bool
    params: StepParams
    entropy: float
    selected: Tensor
    metrics: dict[str, float] = field(default_factory=dict)


class STARE:
    """STARE's state across steps (the controller: gate, W, M, last entropy) and its weights for each step.

    ``STARE(settings, group_size=G)``; ``group_size`` is needed by scope "group" only. Call ``step`` once per
    training step; under ``torch.distributed`` every rank calls it (the entropy, the "step" scope's selection
    and the telemetry are reduced over ranks). ``state_dict``/``load_state_dict`` save and restore the
    controller, so a resumed run continues its gate and its adaptive W and M.
    """

    def __init__(self, settings: STARESettings | None = None, *, group_size: int | None = None) -> None:
        self.settings = settings if settings is not None else STARESettings()
        if self.settings.scope == "group" and (isinstance(group_size, bool) or not isinstance(group_size, int)):
            raise ValueError(f"group_size={group_size!r}: scope 'group' needs the number of rows per group (int >= 1)")
        self.group_size = group_size
        self.controller = self.settings.as_config().make_controller()
        self.params = self.controller.last_params
        self._rule = self.settings.rule()

    # --------------------------------------------------------------------------------------------- state
    @property
    def w(self) -> float:
        """W for the next update (the adaptive schedule moves it)."""
        return self.controller.w

    @property
    def m(self) -> float:
        return self.controller.m

    @property
    def last_entropy(self) -> float | None:
        return self.controller.last_entropy

    def state_dict(self) -> dict[str, object]:
        """The controller's state (plain Python values: JSON-serialisable)."""
        return {"controller": self.controller.state_dict()}

    def load_state_dict(self, state: dict[str, object]) -> None:
        if "controller" not in state:
            raise ValueError(f"STARE state has keys {sorted(state)}; expected 'controller'")
        self.controller.load_state_dict(state["controller"])
        self.params = self.controller.last_params

    # ---------------------------------------------------------------------------------------------- step
    def step(
        self,
        advantages: Tensor,
        mask: Tensor,
        *,
        logprobs: Tensor | None = None,
        entropy: Tensor | None = None,
        logits: Tensor | None = None,
        tokens: Tensor | None = None,
        temperature: float = 1.0,
        phi: Tensor | None = None,
        generator: torch.Generator | None = None,
    ) -> STAREResult:
        """Measure the step's entropy, move the controller, select and weight.

        advantages: [B] or [B, T]; mask: [B, T] (the tokens the policy sampled). Either ``logprobs`` and
        ``entropy`` ([B, T], the sampled tokens' log-probs and the predictive entropy at the sampling
        temperature), or ``logits`` [B, T, V] with the sampled ``tokens`` [B, T] and the ``temperature`` (then
        Phi comes too). ``phi``: the entropy sensitivity, needed by selector "sensitivity" and the quadrant
        telemetry (computed from logits when given). ``generator``: the draw of selector "random".
        """
        logprobs, entropy, phi = _token_inputs(logprobs, entropy, logits, tokens, temperature, phi)
        self.params = self.controller.update(token_mean_entropy(entropy, mask))
        return self.select(advantages, mask, logprobs=logprobs, entropy=entropy, phi=phi, generator=generator)

    def select(
        self,
        advantages: Tensor,
        mask: Tensor,
        *,
        logprobs: Tensor,
        entropy: Tensor | None = None,
        phi: Tensor | None = None,
        generator: torch.Generator | None = None,
    ) -> STAREResult:
        """The selection and weights under this step's gate, W and M (the last ``step``'s), without moving the
        controller: re-ranking by the updated policy before a later optimizer step of the same batch."""
        params = self.params
        rule = dataclasses.replace(self._rule, w=params.w, m=params.m, gate_on=params.gate_on)
        (weights,), (stats,) = stare_weights_for_scope(
            [logprobs.detach()],
            [advantages.detach()],
            [mask],
            scope=self.settings.scope,
            group_size=self.group_size,
            sensitivity=None if phi is None else [phi.detach()],
            entropy=None if entropy is None else [entropy.detach()],
            generator=generator,
            rule=rule,
        )
        applied = weights if params.gate_on else None
        metrics = stare_step_metrics(params, advantages.detach(), mask, stats.selected, applied, phi)
        h_k = params.gate_entropy if params.gate_entropy is not None else float("nan")
        metrics["entropy"] = h_k
        return STAREResult(weights, bool(params.gate_on), params, h_k, stats.selected, metrics)


def _token_inputs(logprobs, entropy, logits, tokens, temperature, phi) -> tuple[Tensor, Tensor, Tensor | None]:
    """(log-probs, entropy, Phi) from the per-token tensors or from the logits, detached."""
    if logits is not None:
        if logprobs is not None or entropy is not None or tokens is None:
            raise ValueError("pass logits with tokens, or logprobs with entropy, not both")
        with torch.no_grad():
            stats = token_stats_from_logits(
                logits.detach(), tokens, temperature=temperature, with_entropy=True, with_sensitivity=True
            )
            phi = entropy_sensitivity(stats.logprobs, stats.entropy, stats.sum_p2, stats.sum_p2_logp)
        return stats.logprobs, stats.entropy, phi
    if logprobs is None or entropy is None:
        raise ValueError("STARE.step needs logprobs and entropy ([B, T]), or logits and tokens")
    return logprobs.detach(), entropy.detach(), None if phi is None else phi.detach()
