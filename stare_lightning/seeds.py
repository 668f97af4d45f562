"""Seeds derived from a run's seed: one mix, wherever a seed is combined with a step or a rank.

``derived_seed(seed, offset)`` is ``seed * 1_000_003 + offset``: the multiplier is a prime above any step count
or rank a run reaches, so distinct ``(seed, offset)`` pairs give distinct seeds. The training step's seed is the
run's seed mixed with the optimizer step; STARE's random selector mixes the step's seed with the rank, so that the
ranks' draws differ.
"""

from __future__ import annotations

__all__ = ["SEED_STRIDE", "derived_seed"]

SEED_STRIDE = 1_000_003


def derived_seed(seed: int, offset: int) -> int:
    """``seed`` mixed with ``offset`` (an optimizer step, a rank): distinct for distinct pairs while ``offset`` stays
    below ``SEED_STRIDE``."""
    return seed * SEED_STRIDE + offset
