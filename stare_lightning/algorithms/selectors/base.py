"""What every selector is: its inputs, its entry in the registry, and the check of what it reads."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from stare_lightning.algorithms.registry import Registry

__all__ = ["STARE_SELECTORS", "RankingInputs", "Selector", "required"]


@dataclass(frozen=True)
class RankingInputs:
    """One part's statistics, each [B, T]: the log-probs of the sampled tokens, their entropy sensitivity Phi and
    the distribution's entropy (None where the step did not compute them), and a seeded generator."""

    logprobs: Tensor
    phi: Tensor | None = None
    entropy: Tensor | None = None
    generator: torch.Generator | None = None


@dataclass(frozen=True)
class Selector:
    score: Callable[[RankingInputs], Tensor]  # [B, T], highest first; read at valid tokens only
    needs_phi: bool = False
    needs_entropy: bool = False
    follows_policy: bool = True


STARE_SELECTORS: Registry[Selector] = Registry("algorithm.stare.selector")


def required(inputs: RankingInputs, name: str, selector: str) -> Tensor:
    """The statistic ``name`` of ``inputs``, or a clear error when the step did not provide it."""
    value = getattr(inputs, name)
    if value is None:
        raise ValueError(f"{name}=None is not allowed with selector={selector!r}: pass it per token")
    if value.shape != inputs.logprobs.shape:
        raise ValueError(f"{name} has shape {tuple(value.shape)}; expected {tuple(inputs.logprobs.shape)}")
    return value
