"""The control: the same number of tokens of each advantage sign as any other selector takes (top P of T+ and
of T-), chosen uniformly at random from a seeded generator. Against it, a selector shows whether *which* tokens
are reweighted matters, or only how many. Its ranking does not follow the policy, so it is drawn once per step."""

from __future__ import annotations

import torch
from torch import Tensor

from stare_lightning.algorithms.selectors.base import STARE_SELECTORS, RankingInputs, Selector


def uniform(inputs: RankingInputs) -> Tensor:
    if inputs.generator is None:
        raise ValueError("generator=None is not allowed with selector='random': pass a seeded torch.Generator")
    draw = torch.rand(inputs.logprobs.shape, generator=inputs.generator, dtype=torch.float64)
    return draw.to(inputs.logprobs.device)


STARE_SELECTORS.register("random")(Selector(score=uniform, follows_policy=False))
