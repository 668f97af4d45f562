"""Entropy telemetry: token-mean entropy, STARE quadrant mass, and the first-order entropy forecast
(docs/method.md, section 5).

Thin torchmetrics classes over ``functional``; see its docstring for the conventions (A == 0 tokens in no
quadrant, dH as a per-token mean over all valid tokens, NaN for 0/0). The windowed forecast correlation
goes beyond the paper, which only asks to log predicted against realised change.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from stare_lightning.metrics.base import TelemetryMetric, replicated
from stare_lightning.metrics.functional import (
    _entropy_forecast_compute,
    _entropy_forecast_update,
    _quadrant_compute,
    _quadrant_update,
    _same_batch_change_compute,
    _same_batch_change_update,
    _token_entropy_compute,
    _token_entropy_update,
)


class TokenEntropy(TelemetryMetric):
    """Token mean of per-token entropy over valid tokens: ``{"entropy": ...}``.

    ``update(entropy [B, T], mask [B, T])``; exact across micro-batches and ranks (sum and count states).
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._sum_state("entropy_sum")
        self._sum_state("token_count", dtype=torch.int64)

    def update(self, entropy: Tensor, mask: Tensor) -> None:
        entropy_sum, token_count = _token_entropy_update(entropy, mask)
        self._accumulate(entropy_sum=entropy_sum, token_count=token_count)

    def compute(self) -> dict[str, Tensor]:
        return _token_entropy_compute(self.entropy_sum, self.token_count)


class QuadrantMass(TelemetryMetric):
    """Token share, weight share and dH of the four sign(A) x high/low quadrants, proxy and exact.

    ``update(advantages [B, T] or [B], mask [B, T], phi [B, T], omega [B, T] | None, selected [B, T] | None)``.
    ``omega`` None means all ones; ``selected`` None means an empty selected set (every proxy token "low").
    Keys: ``quadrant/{proxy,exact}/{pos_high,pos_low,neg_high,neg_low}/{tokens,weight,dH}``.
    The four dH of one definition add up to the token mean of omega * A * Phi; times the step size this
    is the first-order predicted entropy change.
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._sum_state("tokens", (2, 4), dtype=torch.int64)
        self._sum_state("weight", (2, 4))
        self._sum_state("dh", (2, 4))
        self._sum_state("valid_count", dtype=torch.int64)

    def update(
        self,
        advantages: Tensor,
        mask: Tensor,
        phi: Tensor,
        omega: Tensor | None = None,
        selected: Tensor | None = None,
    ) -> None:
        tokens, weight, dh, valid_count = _quadrant_update(advantages, mask, phi, omega, selected)
        self._accumulate(tokens=tokens, weight=weight, dh=dh, valid_count=valid_count)

    def compute(self) -> dict[str, Tensor]:
        return _quadrant_compute(self.tokens, self.weight, self.dh, self.valid_count)


class SameBatchEntropyChange(TelemetryMetric):
    """The entropy change of the step's update measured on the step's own tokens (``algorithms.entropy_change``).

    ``update(realised [B, T], first_order [B, T], advantages [B] or [B, T], mask [B, T], phi [B, T])``, with
    Phi of the rollout policy. Keys: ``entropy/realized_delta_same_batch`` and ``entropy/first_order_delta``
    (token means), ``quadrant/first_order/<quadrant>`` (each exact quadrant's first-order sum over all valid
    tokens, so the four add up to the first-order delta when no token has A == 0).
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._sum_state("realised_sum")
        self._sum_state("first_sum")
        self._sum_state("quadrant_sums", (4,))
        self._sum_state("valid_count", dtype=torch.int64)

    def update(self, realised: Tensor, first_order: Tensor, advantages: Tensor, mask: Tensor, phi: Tensor) -> None:
        realised_sum, first_sum, quadrant_sums, valid_count = _same_batch_change_update(
            realised, first_order, advantages, mask, phi
        )
        self._accumulate(
            realised_sum=realised_sum, first_sum=first_sum, quadrant_sums=quadrant_sums, valid_count=valid_count
        )

    def compute(self) -> dict[str, Tensor]:
        return _same_batch_change_compute(self.realised_sum, self.first_sum, self.quadrant_sums, self.valid_count)


class EntropyForecast(TelemetryMetric):
    """Predicted against realised entropy change, step by step, with a windowed Pearson correlation.

    Call ``update(entropy, predicted_delta)`` once per training step k with the step's batch entropy H_k
    and the first-order predicted change of the update made at step k (e.g. step size times the sum of
    the exact-quadrant dH). Each call after the first completes the pair
    (predicted change of step k-1, H_k - H_{k-1}). ``compute()`` returns
    ``entropy/predicted_delta`` and ``entropy/realized_delta`` of the latest completed pair (NaN before
    the second step) and ``entropy/forecast_corr`` over the finite pairs among the last ``window``
    (NaN with fewer than two). A NaN predicted delta (telemetry skipped that step) just drops that pair.
    H_{k+1} is measured on a different batch than H_k, so the realised change carries batch noise.

    Unlike the other metrics this one is stateful across steps: never ``reset()`` it between steps, and
    call ``update`` then ``compute`` (``forward`` does exactly that). Its states are persistent, so the
    window survives a checkpoint.

    Across ranks: the inputs must already be global (the step entropy and the prediction reduced over all
    ranks, e.g. from a synced ``TokenEntropy`` and ``QuadrantMass``), so every rank holds the same states.
    Syncing therefore keeps rank 0's copy instead of summing, and warns if the ranks disagree.
    """

    def __init__(self, window: int = 20, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if window < 2:
            raise ValueError(f"window must be at least 2, got {window}")
        self.window = int(window)
        nan = float("nan")
        for name in ("predicted_history", "realized_history"):
            self.add_state(name, torch.full((self.window,), nan, dtype=torch.float64), replicated, persistent=True)
        self.add_state("last_entropy", torch.tensor(nan, dtype=torch.float64), replicated, persistent=True)
        self.add_state("last_predicted", torch.tensor(nan, dtype=torch.float64), replicated, persistent=True)
        self.add_state("steps", torch.tensor(0, dtype=torch.int64), replicated, persistent=True)

    def update(self, entropy: Tensor | float, predicted_delta: Tensor | float) -> None:
        (
            self.predicted_history,
            self.realized_history,
            self.last_entropy,
            self.last_predicted,
            self.steps,
        ) = _entropy_forecast_update(
            self.predicted_history,
            self.realized_history,
            self.last_entropy,
            self.last_predicted,
            self.steps,
            entropy,
            predicted_delta,
        )

    def compute(self) -> dict[str, Tensor]:
        return _entropy_forecast_compute(self.predicted_history, self.realized_history)

    def forward(self, entropy: Tensor | float, predicted_delta: Tensor | float) -> dict[str, Tensor]:
        """Record one step and return the values after it (no reset, unlike torchmetrics' forward)."""
        self.update(entropy, predicted_delta)
        return self.compute()
