"""One step's STARE metrics as plain floats, for a training loop outside this project's trainer (``integrations``):
the gate, W and M, the selected shares and the quadrants, each under this project's name and summed over ranks
before any ratio (so they do not depend on the number of processes).

Built on the same functional pairs (``functional``) as the trainer's torchmetrics classes, so the numbers are the
trainer's for the same tokens.
"""

from __future__ import annotations

import torch
from torch import Tensor

from stare_lightning.distributed import all_reduce
from stare_lightning.metrics.functional import (
    _quadrant_compute,
    _quadrant_update,
    _ratio,
    _selected_fraction_compute,
    _selected_fraction_update,
    _token_entropy_update,
)

__all__ = ["stare_step_metrics", "token_mean_entropy"]


def token_mean_entropy(entropy: Tensor, mask: Tensor) -> float:
    """H_k: the mean entropy over every rank's valid tokens (``entropy``, ``mask``: [B, T])."""
    entropy_sum, count = _token_entropy_update(entropy, mask.bool())
    totals = all_reduce(torch.stack([entropy_sum, count.to(entropy_sum.dtype)]), device=entropy.device)
    return float(_ratio(totals[0], totals[1]))


def stare_step_metrics(
    params, advantages: Tensor, mask: Tensor, selected: Tensor, omega: Tensor | None, phi: Tensor | None
) -> dict[str, float]:
    """``stare/gate_on``, ``stare/w``, ``stare/m``, ``stare/gate_entropy`` (from ``params``, the step's
    ``StepParams``), ``stare/selected_frac/pos|neg`` (of ``selected`` [B, T] among each advantage sign), and, when
    ``phi`` (the entropy sensitivity [B, T]) is given, ``quadrant/{proxy,exact}/<quadrant>/{tokens,weight,dH}``
    under the weights ``omega`` applied (None: all ones, the gate closed)."""
    device = selected.device
    out = {
        "stare/gate_on": float(params.gate_on),
        "stare/w": float(params.w),
        "stare/m": float(params.m),
        "stare/gate_entropy": float("nan") if params.gate_entropy is None else float(params.gate_entropy),
    }
    counts = all_reduce(_selected_fraction_update(selected, advantages, mask), device=device)
    out.update({k: float(v) for k, v in _selected_fraction_compute(counts).items()})
    if phi is not None:
        states = _quadrant_update(advantages, mask, phi, omega, selected)
        states = [all_reduce(s, device=device) for s in states]
        out.update({k: float(v) for k, v in _quadrant_compute(*states).items()})
    return out
