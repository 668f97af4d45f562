"""STARE's controller: the entropy gate and the (optionally adaptive) weights W and M, one update per step.

What it implements: docs/method.md section 3. The gate opens when the measured batch entropy is strictly
below the target; when adaptive, W moves up and M down by alpha while entropy is below target (and back
otherwise), clipped to [1, w_max] and [m_min, 1]. Departure from the reference code: the updated W/M
apply from the step after the measurement (the paper's formula); ``timing="same_step"`` applies them at
once, as the reference code does. The state is checkpointed (the reference code loses it on resume).

The target may follow a schedule over the steps (``algorithm.stare.target_schedule``; beyond the paper, whose target
is constant): at the k-th measured step (k = 0, 1, ...), with progress p = min(k / horizon, 1),
``linear`` is H_start + (H_end - H_start) p and ``cosine`` is H_end + (H_start - H_end) (1 + cos(pi p)) / 2, where
H_start = ``target_entropy``, H_end = ``target_end`` and horizon = ``target_horizon``; both hold H_end after the
horizon. ``constant`` (the default) is ``target_entropy`` at every step. A step with a non-finite entropy does not
advance the schedule (k counts measured steps, and is checkpointed).
Settings are range-checked by ``STAREConfig``, which builds the controller. The controller is a
``StepController`` (``entropy_controller.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from torch import Tensor

from stare_lightning.algorithms.entropy_controller import SignWeights, finite_entropy, missing_state

__all__ = ["STARE_TIMINGS", "TARGET_SCHEDULES", "STAREController", "StepParams", "scheduled_target"]

STARE_TIMINGS = ("next_step", "same_step")
TARGET_SCHEDULES = ("constant", "linear", "cosine")


def scheduled_target(schedule: str, start: float, end: float, horizon: int, step: int) -> float:
    """The gate's target at measured step ``step`` (0-based) under ``schedule`` (module docstring)."""
    if schedule == "constant":
        return start
    progress = min(step / horizon, 1.0)
    if schedule == "linear":
        return start + (end - start) * progress
    if schedule == "cosine":
        return end + (start - end) * 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"target schedule {schedule!r} is not allowed: choose one of {TARGET_SCHEDULES}")


_STATE_KEYS = {"gate_on", "w", "m", "last_entropy", "last_params", "num_updates"}


@dataclass(frozen=True)
class StepParams:
    """What STARE uses in one step: the gate and the weights W (on L+) and M (on L-)."""

    gate_on: bool
    w: float
    m: float
    gate_entropy: float | None = field(default=None, compare=False)  # what the gate compared to its target
    signs: SignWeights = SignWeights()  # token weights by advantage sign from a step controller (1, 1: none)


# The parameters of a step without STARE: gate closed, every weight 1 (plain GRPO).
GRPO_PARAMS = StepParams(gate_on=False, w=1.0, m=1.0)


class STAREController:
    """Entropy gate and (optionally adaptive) weights, one `update` per training step.

    update(H) measures the step's batch entropy H and returns the StepParams for THIS step:
    gate_on = H < H_tgt (strict), H_tgt this step's target under the schedule (``target_entropy`` when constant).
    When adaptive, W <- clip(W + alpha sign(H_tgt - H), 1, w_max) and M <- clip(M - alpha sign(H_tgt - H), m_min, 1);
    with timing "next_step" this step uses the values from before the update, with "same_step" the updated values.
    Attributes: gate_on, w, m (the values the NEXT update starts from), last_entropy, last_params.
    A non-finite entropy leaves the state unchanged, warns, and returns the previous step's params.
    """

    def __init__(
        self,
        target_entropy: float = 0.3,
        w: float = 1.1,
        m: float = 0.9,
        adaptive: bool = False,
        alpha: float = 0.01,
        w_max: float = 1.5,
        m_min: float = 0.5,
        timing: str = "next_step",
        gate_starts_open: bool = False,
        target_schedule: str = "constant",
        target_end: float | None = None,
        target_horizon: int | None = None,
    ) -> None:
        self.target_entropy = float(target_entropy)
        self.target_schedule = target_schedule
        self.target_end = self.target_entropy if target_end is None else float(target_end)
        self.target_horizon = 1 if target_horizon is None else int(target_horizon)
        self.adaptive = bool(adaptive)
        self.alpha = float(alpha)
        self.w_max = float(w_max)
        self.m_min = float(m_min)
        self.timing = timing
        self.w = float(w)
        self.m = float(m)
        # What a step gets before any finite entropy was measured (the reference code starts open).
        self.gate_on = bool(gate_starts_open)
        self.last_entropy: float | None = None
        self.last_params = StepParams(gate_on=self.gate_on, w=self.w, m=self.m)
        self.num_updates = 0

    def _target_at(self, step: int) -> float:
        return scheduled_target(self.target_schedule, self.target_entropy, self.target_end, self.target_horizon, step)

    def update(self, entropy: float | Tensor) -> StepParams:
        value = finite_entropy(entropy, "STAREController", "keeping the previous state")
        if value is None:
            return self.last_params
        target = self._target_at(self.num_updates)
        gate_on = value < target
        before = (self.w, self.m)
        if self.adaptive:
            direction = float((target > value) - (target < value))
            self.w = min(max(self.w + self.alpha * direction, 1.0), self.w_max)
            self.m = min(max(self.m - self.alpha * direction, self.m_min), 1.0)
        use_w, use_m = before if self.timing == "next_step" else (self.w, self.m)
        self.gate_on = gate_on
        self.last_entropy = value
        self.last_params = StepParams(gate_on=gate_on, w=use_w, m=use_m, gate_entropy=value)
        self.num_updates += 1
        return self.last_params

    def metrics(self) -> dict[str, float]:
        """``stare/target``: the target the last measured step's gate compared with (the first step's before any)."""
        return {"stare/target": self._target_at(max(self.num_updates - 1, 0))}

    def state_dict(self) -> dict[str, object]:
        return {
            "gate_on": self.gate_on,
            "w": self.w,
            "m": self.m,
            "last_entropy": self.last_entropy,
            "last_params": {"gate_on": self.last_params.gate_on, "w": self.last_params.w, "m": self.last_params.m},
            "num_updates": self.num_updates,
        }

    def load_state_dict(self, state: dict[str, object]) -> None:
        missing_state("STAREController", state, _STATE_KEYS)
        self.gate_on = bool(state["gate_on"])
        self.w = float(state["w"])
        self.m = float(state["m"])
        last = state["last_entropy"]
        self.last_entropy = None if last is None else float(last)
        lp = state["last_params"]
        self.last_params = StepParams(gate_on=bool(lp["gate_on"]), w=float(lp["w"]), m=float(lp["m"]))
        self.num_updates = int(state["num_updates"])
