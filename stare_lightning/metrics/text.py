"""Reflection-word counts over response texts (docs/method.md, section 5).

The paper names reflection words without a list or matching rule; the default list and the matching rule
(case-insensitive whole words with hyphens inside words, longest entry first, no overlaps) are this
project's, described in ``functional``. Strings never cross ranks: each update reduces its texts to counts.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from stare_lightning.metrics.base import TelemetryMetric
from stare_lightning.metrics.functional import (
    DEFAULT_REFLECTION_WORDS,
    _reflection_compute,
    _reflection_update,
    reflection_key,
    reflection_pattern,
)


class ReflectionWords(TelemetryMetric):
    """Mean count per response of each reflection word or phrase, and of all of them together.

    ``update(responses: Sequence[str])``. Keys: ``reflection/per_response`` and ``reflection/<word>``
    for each word (spaces in phrases become underscores, e.g. ``reflection/let_me_check``).
    """

    def __init__(self, words: Sequence[str] = DEFAULT_REFLECTION_WORDS, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.words = tuple(words)
        self.pattern = reflection_pattern(self.words)
        self._sum_state("counts", (len(self.words),), dtype=torch.int64)
        self._sum_state("num_responses", dtype=torch.int64)

    @property
    def names(self) -> list[str]:
        """The keys ``compute()`` returns."""
        return ["reflection/per_response"] + [reflection_key(w) for w in self.words]

    def update(self, responses: Sequence[str]) -> None:
        if isinstance(responses, str):
            raise TypeError("pass a sequence of response texts, not one string")
        counts, num_responses = _reflection_update(responses, self.pattern, len(self.words), self.device)
        self._accumulate(counts=counts, num_responses=num_responses)

    def compute(self) -> dict[str, Tensor]:
        return _reflection_compute(self.counts, self.num_responses, self.words)
