"""A proportional-integral entropy controller on the loss weights of positive and negative samples.

What it implements, in the manner of EntroPIC (Yang et al. 2025, "EntroPIC: Towards Stable Long-Term Training of
LLMs via Entropy Stabilization with Proportional-Integral Control", arXiv 2511.15248): positive-advantage tokens
mostly lower the policy's entropy and negative-advantage tokens mostly raise it (docs/method.md, section 2), so
scaling the two sets against each other steers the entropy. Once per step, from the step's batch entropy H_k:

    e_k = H_tgt - H_k                                   (positive: entropy below target)
    I_k = clip(I_{k-1} + e_k, -I_max, I_max)            (the integral, clipped: anti-windup)
    u_k = clip(K_p e_k + K_i I_k, -u_max, u_max)        (the control signal)
    omega = 1 - u_k on tokens with A > 0,  1 + u_k on tokens with A < 0,  1 on A = 0

and this step's loss applies omega, after the clip, like STARE's weight (it multiplies STARE's where both are on).
Below target u > 0: positive samples count less and negative samples more, so the entropy rises; above target the
reverse. With u_max < 1 no weight reaches zero or flips a gradient. I_max bounds how far the integral can carry the
signal after a long excursion (windup); with K_i I_max <= u_max the clip on u is never held by the integral alone.

Departures from the paper (this law is designed from control principles and the paper's published outline, not
transcribed from its equations): the paper concentrates the control on
high-probability positive tokens and low-probability negative tokens; here every token of each advantage sign gets
its set's weight, one scalar pair per step. The integral is clipped (the paper's anti-windup, if any, is not known
here), the signal is clipped to [-u_max, u_max], and the weights apply in the same step as the measurement (the
scoring pass measures H_k before the update). Settings (``algorithm.entropy_control.pi``) are range-checked by
``PIControlSettings``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor

from stare_lightning.algorithms.entropy_controller import SignWeights, finite_entropy, missing_state

__all__ = ["EntropyPIController"]

_STATE_KEYS = ("integral", "error", "signal", "last_entropy", "num_updates")  # plain numbers, what a checkpoint keeps


class EntropyPIController:
    """The PI law of the module docstring; a ``StepController`` whose ``update`` returns this step's
    ``SignWeights``. A non-finite entropy warns, keeps the state and repeats the previous weights."""

    def __init__(self, target: float, kp: float, ki: float, integral_limit: float, max_signal: float) -> None:
        self.target = float(target)
        self.kp, self.ki = float(kp), float(ki)
        self.integral_limit, self.max_signal = float(integral_limit), float(max_signal)
        self.integral = 0.0
        self.error = 0.0
        self.signal = 0.0
        self.last_entropy: float | None = None
        self.num_updates = 0

    @property
    def weights(self) -> SignWeights:
        """The weights of the last step's control signal (1, 1 before any)."""
        return SignWeights(positive=1.0 - self.signal, negative=1.0 + self.signal)

    def update(self, entropy: float | Tensor) -> SignWeights:
        value = finite_entropy(entropy, "EntropyPIController", "keeping the previous state")
        if value is None:
            return self.weights
        self.error = self.target - value
        self.integral = min(max(self.integral + self.error, -self.integral_limit), self.integral_limit)
        raw = self.kp * self.error + self.ki * self.integral
        self.signal = min(max(raw, -self.max_signal), self.max_signal)
        self.last_entropy = value
        self.num_updates += 1
        return self.weights

    def metrics(self) -> dict[str, float]:
        """``pi/signal`` (u_k), ``pi/error`` (e_k), ``pi/integral`` (I_k), ``pi/weight_pos``, ``pi/weight_neg``."""
        weights = self.weights
        return {
            "pi/signal": self.signal,
            "pi/error": self.error,
            "pi/integral": self.integral,
            "pi/weight_pos": weights.positive,
            "pi/weight_neg": weights.negative,
        }

    def state_dict(self) -> dict[str, Any]:
        return {key: getattr(self, key) for key in _STATE_KEYS}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        missing_state("EntropyPIController", state, _STATE_KEYS)
        self.integral, self.error = float(state["integral"]), float(state["error"])
        self.signal = float(state["signal"])
        last = state["last_entropy"]
        self.last_entropy = None if last is None else float(last)
        self.num_updates = int(state["num_updates"])
