"""What an entropy controller is in this project: what it reads, what it returns, what state it keeps.

Every method here that steers the policy's entropy acts on the policy loss in one of two places, by what it reads:

- A **step controller** (``StepController``) reads the step's batch entropy H_k once per step (``update``), from
  the scoring pass before the step's loss, and returns what that step's loss applies:

  - ``STAREController`` (``stare_controller.py``, ``algorithm.stare``): STARE's gate and its token weights W and M
    (``StepParams``);
  - ``AdaptiveEntropyCoefficient`` (``entropy_control.py``, ``algorithm.entropy_bonus.target``): the entropy-bonus
    coefficient, the weight of a loss term;
  - ``EntropyPIController`` (``entropy_pi.py``, ``algorithm.entropy_control.name=pi``): token weights by advantage
    sign (``SignWeights``).

  It carries state from step to step; ``state_dict`` / ``load_state_dict`` put that state into every checkpoint
  (plain Python values), so a resumed run continues exactly. ``metrics`` names its control signal for the step's
  log (without the ``train/`` prefix). A non-finite H_k (a step whose batch had no valid token, or a diverged
  forward) is caught by ``finite_entropy``, the one guard they all call: it warns, and the controller keeps its
  state and repeats its previous decision.

- A **token control** (``TokenControl``, the entries of ``entropy_control.ENTROPY_CONTROLS``: Clip-Cov, KL-Cov, the
  80/20 rule) reads one micro-batch's per-token statistics (log-probs, old log-probs, advantages, mask, entropy)
  and returns ``ControlTerms``: tokens whose gradient is detached, a per-token penalty added to the loss, or the
  clip bounds dropped (KL-Cov). Token controls keep no state across steps (Clip-Cov's draw uses torch's RNG, which
  Lightning's checkpoint does not restore; the statistics are the micro-batch's own).

A run may combine one step controller of each kind with one token control; what each setting combines with is
checked by ``AlgorithmConfig``.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from torch import Tensor

__all__ = ["ControlTerms", "SignWeights", "StepController", "TokenControl", "finite_entropy", "missing_state"]


def finite_entropy(entropy: float | Tensor, owner: str, keeping: str) -> float | None:
    """H_k as a float, or None (after a RuntimeWarning naming ``owner`` and what it keeps) when it is not finite."""
    value = float(entropy.detach().float().item()) if isinstance(entropy, Tensor) else float(entropy)
    if math.isfinite(value):
        return value
    warnings.warn(f"{owner}.update got a non-finite entropy ({value}); {keeping}", RuntimeWarning, stacklevel=3)
    return None


@runtime_checkable
class StepController(Protocol):
    """A controller that reads the step's batch entropy once per step and decides what that step's loss applies."""

    def update(self, entropy: float | Tensor) -> Any:
        """Read H_k (nats; non-finite: warn, keep the state, repeat the previous decision) and return this step's
        decision: ``StepParams``, a coefficient, or ``SignWeights``."""

    def metrics(self) -> dict[str, float]:
        """The control signal after the last ``update``, keyed by metric name without ``train/``."""

    def state_dict(self) -> dict[str, Any]:
        """The state a checkpoint keeps (plain Python values)."""

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore ``state_dict``'s output; a missing key is refused by name."""


@dataclass(frozen=True)
class ControlTerms:
    """What a token control does to one micro-batch's surrogate."""

    detach: Tensor | None = None  # bool [B, T]: tokens whose surrogate gradient is removed (value kept)
    penalty: Tensor | None = None  # [B, T]: added to the per-token loss
    controlled: Tensor | None = None  # bool [B, T]: tokens detached or penalised (telemetry)
    unclipped: bool = False  # the surrogate runs without its clip (KL-Cov replaces the clip by its penalty)


class TokenControl(Protocol):
    """A token control: (its settings node of ``algorithm.entropy_control``, the policy loss's clip, logprobs,
    old_logprobs, advantages [B, T], mask, entropy or None, generator) -> ``ControlTerms`` of one micro-batch."""

    def __call__(self, settings, clip, logprobs, old_logprobs, adv, mask, entropy, generator) -> ControlTerms: ...


@dataclass(frozen=True)
class SignWeights:
    """Token weights by advantage sign for one step: ``positive`` on every token with A > 0, ``negative`` on every
    token with A < 0, 1 on A = 0. Both 1 leaves the loss untouched (no multiplication at all)."""

    positive: float = 1.0
    negative: float = 1.0

    @property
    def neutral(self) -> bool:
        return self.positive == 1.0 and self.negative == 1.0


def missing_state(owner: str, state: Mapping[str, Any], keys: Iterable[str]) -> None:
    """Refuse a checkpointed state that lacks any of ``keys``, naming them."""
    missing = set(keys) - set(state)
    if missing:
        raise ValueError(f"{owner} state is missing keys {sorted(missing)}")
