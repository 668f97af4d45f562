"""Warn about, or stop, a run whose policy entropy stays outside a band (collapse or blow-up)."""

from __future__ import annotations

import warnings

import lightning
from lightning.pytorch.callbacks import Callback

from stare_lightning.config.checks import choice, number


class EntropyGuard(Callback):
    """Warns about, or stops, a run whose logged entropy stays outside ``[low, high]`` for ``patience`` steps.

    Args:
        low: the lowest entropy (nats per token) counted as healthy; below it the policy is collapsing.
        high: the highest entropy counted as healthy; above it the policy is blowing up (``.inf``: no bound).
        patience: training steps in a row outside the band before the guard acts.
        action: ``warn`` (a line in the log and on the terminal) or ``stop`` (ends the fit after the step).
        metric: the logged metric the guard reads.
    """

    def __init__(
        self,
        low: float = 0.01,
        high: float = 10.0,
        patience: int = 20,
        action: str = "warn",
        metric: str = "train/entropy",
    ) -> None:
        p = "callbacks.entropy_guard."
        choice(f"{p}action", action, ("warn", "stop"))
        number(f"{p}low", low, low=0.0)
        number(f"{p}high", high, allow_inf=True)
        if not low < high:
            raise ValueError(f"{p}high={high!r} is out of range: must be > {p}low={low!r}")
        number(f"{p}patience", patience, low=1, integer=True)
        self.low, self.high, self.patience, self.action, self.metric = low, high, patience, action, metric
        self.steps_outside = 0

    def on_train_batch_end(self, trainer: lightning.Trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        value = trainer.callback_metrics.get(self.metric)
        if value is None:
            return
        entropy = float(value)
        self.steps_outside = self.steps_outside + 1 if not self.low <= entropy <= self.high else 0
        if self.steps_outside == self.patience:
            message = (
                f"{self.metric}={entropy:.4f} has been outside [{self.low}, {self.high}] for {self.patience} steps "
                f"(step {trainer.global_step})"
            )
            if self.action == "stop":
                trainer.should_stop = True
                message += ": stopping"
            warnings.warn(message, RuntimeWarning, stacklevel=2)

    def state_dict(self) -> dict:
        return {"steps_outside": self.steps_outside}

    def load_state_dict(self, state_dict: dict) -> None:
        self.steps_outside = state_dict.get("steps_outside", 0)
