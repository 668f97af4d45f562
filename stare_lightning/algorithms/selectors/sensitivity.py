"""Beyond the paper: rank by the exact entropy sensitivity Phi(o; pi) (``algorithms/sensitivity.py``), whose sign
and size say how much a positive update on the token raises the entropy; surprisal is its first-order proxy."""

from __future__ import annotations

import torch
from torch import Tensor

from stare_lightning.algorithms.selectors.base import STARE_SELECTORS, RankingInputs, Selector, required


def sensitivity(inputs: RankingInputs) -> Tensor:
    return required(inputs, "phi", "sensitivity").detach().to(torch.float64)


STARE_SELECTORS.register("sensitivity")(Selector(score=sensitivity, needs_phi=True))
