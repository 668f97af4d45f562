"""Disjoint, deterministic splits of a generated task: the validation problems are drawn first from their own
seeded stream, and the training stream skips every one of them (training may repeat its own problems when the
space is small). The validation split so depends only on the task's settings, the seed and ``val_size``."""

from __future__ import annotations

import random
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class DisjointSplits:
    """How task ``task`` draws its splits; ``noun``: what one problem is called in the errors; ``remedy``: what
    gives more distinct problems, as the error says it."""

    task: str
    noun: str
    remedy: str

    def draw(
        self,
        split: str,
        size: int,
        *,
        seed: int,
        val_size: int,
        draw: Callable[[random.Random], Any],
        key: Callable[[Any], Hashable] = lambda problem: problem,
    ) -> list:
        """The problems of ``split``: ``val_size`` distinct ones ("val"), else ``size`` whose ``key`` no validation
        problem has. ``draw(rng)`` draws one problem."""
        val_rng = random.Random(f"{self.task}/val/{seed}")
        val: list = []
        val_keys: set = set()
        attempts = 0
        while len(val) < val_size:
            attempts += 1
            if attempts > 200 * val_size + 1000:
                raise ValueError(
                    f"{self.task}: only {len(val)} distinct {self.noun}s found for val_size={val_size}; {self.remedy}"
                )
            problem = draw(val_rng)
            if key(problem) not in val_keys:
                val_keys.add(key(problem))
                val.append(problem)
        if split == "val":
            return val
        return self._train(size, seed, draw, lambda problem: key(problem) in val_keys)

    def _train(self, size: int, seed: int, draw: Callable[[random.Random], Any], in_val: Callable) -> list:
        train_rng = random.Random(f"{self.task}/train/{seed}")
        train: list = []
        misses = 0
        while len(train) < size:
            problem = draw(train_rng)
            if in_val(problem):
                misses += 1
                if misses > 1000 + 100 * size:
                    raise ValueError(
                        f"{self.task}: every {self.noun} of these settings is in the validation split; "
                        "lower data.val_size"
                    )
                continue
            train.append(problem)
        return train
