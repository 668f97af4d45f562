"""The paper's selector: rank by surprisal -log pi(o), the most surprising sampled tokens first."""

from __future__ import annotations

import torch
from torch import Tensor

from stare_lightning.algorithms.selectors.base import STARE_SELECTORS, RankingInputs, Selector


def surprisal(inputs: RankingInputs) -> Tensor:
    return -inputs.logprobs.detach().to(torch.float64)


STARE_SELECTORS.register("surprisal")(Selector(score=surprisal))
