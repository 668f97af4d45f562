"""An ablation: rank by the predictive entropy H(pi) at the token's position instead of the sampled token's
surprisal. Both are high where the policy is unsure; surprisal also asks whether the sampled token was an unlikely
one (its expectation over the sampled token is the entropy), which is what the first-order picture says matters."""

from __future__ import annotations

import torch
from torch import Tensor

from stare_lightning.algorithms.selectors.base import STARE_SELECTORS, RankingInputs, Selector, required


def predictive_entropy(inputs: RankingInputs) -> Tensor:
    return required(inputs, "entropy", "entropy").detach().to(torch.float64)


STARE_SELECTORS.register("entropy")(Selector(score=predictive_entropy, needs_entropy=True))
