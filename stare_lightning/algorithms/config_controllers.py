"""Settings of the step controllers that are entries of ``algorithm.entropy_control`` (``entropy_controller.py``):
the PI controller's node ``algorithm.entropy_control.pi``. Like the rest of the schema, importing it loads no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from stare_lightning.config.checks import number

__all__ = ["PIControlSettings"]


@dataclass
class PIControlSettings:
    """The PI controller in EntroPIC's style (``algorithms/entropy_pi.py``): it weights positive-advantage tokens by
    1 - u and negative-advantage tokens by 1 + u, u = clip(kp e + ki I, -max_signal, max_signal), e = target - H_k,
    I the running sum of e clipped to [-integral_limit, integral_limit]. The defaults are tuned for the offline
    toy (scripts/entropy_controller_study.sh says why)."""

    target: float = 0.3
    """The batch entropy (nats) the controller steers toward."""
    kp: float = 2.0
    """Proportional gain: signal per nat of error."""
    ki: float = 0.1
    """Integral gain: signal per nat-step of accumulated error."""
    integral_limit: float = 2.0
    """Bound on the accumulated error, in nat-steps (anti-windup)."""
    max_signal: float = 0.5
    """Bound on the control signal u: the weights stay within [1 - max_signal, 1 + max_signal]."""

    def __post_init__(self) -> None:
        p = "algorithm.entropy_control.pi."
        number(f"{p}target", self.target, low=0.0)
        number(f"{p}kp", self.kp, low=0.0)
        number(f"{p}ki", self.ki, low=0.0)
        number(f"{p}integral_limit", self.integral_limit, low=0.0, low_open=True)
        number(f"{p}max_signal", self.max_signal, low=0.0, high=1.0, low_open=True, high_open=True)
        if self.kp == 0 and self.ki == 0:
            raise ValueError(f"{p}kp=0 and {p}ki=0 leave every weight at 1: set a gain above 0")

    def make_controller(self):
        """A fresh controller with these settings."""
        from stare_lightning.algorithms.entropy_pi import EntropyPIController

        return EntropyPIController(
            target=self.target,
            kp=self.kp,
            ki=self.ki,
            integral_limit=self.integral_limit,
            max_signal=self.max_signal,
        )
