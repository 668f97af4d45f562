"""A STARE selector: rank the sampled tokens by excess surprisal, -log pi(o) - H(pi).

A token ranks high when it was more surprising than a draw from its own distribution is on average: a rare token
at a position where the model was confident ranks above a token of the same probability at a position where the
model was hesitating.
"""

from __future__ import annotations

import torch
from torch import Tensor

from stare_lightning.algorithms.selectors import STARE_SELECTORS, RankingInputs, Selector, required


def excess_surprisal(inputs: RankingInputs) -> Tensor:
    """-log pi(o) - H(pi) per token [B, T], highest first."""
    entropy = required(inputs, "entropy", "excess_surprisal")
    return -inputs.logprobs.detach().to(torch.float64) - entropy.detach().to(torch.float64)


# needs_entropy: the step computes the per-token entropy for this selector (follows_policy keeps its default,
# True: with algorithm.stare.surprisal_source=current the ranking is made again after each optimizer step).
STARE_SELECTORS.register("excess_surprisal")(Selector(score=excess_surprisal, needs_entropy=True))
