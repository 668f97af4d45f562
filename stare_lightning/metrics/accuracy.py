"""Accuracy over n samples per prompt: avg@n, unbiased pass@k, maj@n, and distinct correct responses.

avg@n and pass@k follow docs/method.md (section 5); pass@k is computed in the product form of the
unbiased estimator. Distinct correct responses go beyond the paper (a diversity check): texts are reduced
to one count per prompt inside ``update``, so only numbers cross ranks. A prompt's group must arrive in
one ``update`` call on one rank (a group split across calls counts as two prompts).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from stare_lightning.metrics.base import TelemetryMetric
from stare_lightning.metrics.functional import (
    _avg_at_n_compute,
    _avg_at_n_update,
    _distinct_correct_compute,
    _distinct_correct_update,
    _pass_at_k_compute,
    _pass_at_k_update,
)


class AvgAtN(TelemetryMetric):
    """Mean over prompts of c / n: ``{"avg@n": ...}``.

    ``update(num_correct [P], num_samples [P] or int)``.
    """

    higher_is_better = True

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._sum_state("total")
        self._sum_state("num_prompts", dtype=torch.int64)

    def update(self, num_correct: Tensor, num_samples: Tensor | int) -> None:
        total, num_prompts = _avg_at_n_update(num_samples, num_correct)
        self._accumulate(total=total, num_prompts=num_prompts)

    def compute(self) -> dict[str, Tensor]:
        return _avg_at_n_compute(self.total, self.num_prompts)


class PassAtK(TelemetryMetric):
    """Mean over prompts of the unbiased pass@k, for one or several k: ``{"pass@<k>": ...}``.

    ``update(num_correct [P], num_samples [P] or int)``; raises ``ValueError`` if some prompt has n < k.
    Keys carry the number, e.g. ``pass@8``.
    """

    higher_is_better = True

    def __init__(self, k: int | Sequence[int] = 1, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        ks = (k,) if isinstance(k, int) else tuple(int(x) for x in k)
        if not ks or any(x < 1 for x in ks) or len(set(ks)) != len(ks):
            raise ValueError(f"k must be distinct positive integers, got {k}")
        self.ks = ks
        self._sum_state("totals", (len(ks),))
        self._sum_state("num_prompts", dtype=torch.int64)

    def update(self, num_correct: Tensor, num_samples: Tensor | int) -> None:
        totals, num_prompts = _pass_at_k_update(num_samples, num_correct, self.ks)
        self._accumulate(totals=totals, num_prompts=num_prompts)

    def compute(self) -> dict[str, Tensor]:
        return _pass_at_k_compute(self.totals, self.num_prompts, self.ks)


class MajorityAtN(TelemetryMetric):
    """Share of prompts whose majority vote over their n samples is correct: ``{"maj@n": ...}``.

    ``update(correct [P] bool)``, one flag per prompt (``rewards.majority.majority_correct``).
    """

    higher_is_better = True

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._sum_state("total")
        self._sum_state("num_prompts", dtype=torch.int64)

    def update(self, correct: Tensor) -> None:
        total, num_prompts = _avg_at_n_update(1, correct.reshape(-1).float())
        self._accumulate(total=total, num_prompts=num_prompts)

    def compute(self) -> dict[str, Tensor]:
        return {"maj@n": _avg_at_n_compute(self.total, self.num_prompts)["avg@n"]}


class DistinctCorrect(TelemetryMetric):
    """Mean over prompts of the number of distinct correct responses: ``{"distinct_correct": ...}``.

    ``update(responses: Sequence[Sequence[str]], correct: Sequence[Sequence[bool]] | Tensor [P, G])``,
    one inner sequence per prompt. Texts are compared with leading/trailing whitespace stripped.
    """

    higher_is_better = True

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._sum_state("total", dtype=torch.int64)
        self._sum_state("num_prompts", dtype=torch.int64)

    def update(self, responses: Sequence[Sequence[str]], correct: Sequence[Sequence[bool]] | Tensor) -> None:
        total, num_prompts = _distinct_correct_update(responses, correct, self.device)
        self._accumulate(total=total, num_prompts=num_prompts)

    def compute(self) -> dict[str, Tensor]:
        return _distinct_correct_compute(self.total, self.num_prompts)
