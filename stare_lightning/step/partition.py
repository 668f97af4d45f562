"""Micro-batches cut the way the reference trainer cuts them: a count from the token budget, balanced contents.

What it implements: the dynamic batch size of the reference trainer's actor (verl 0.7, ``use_dynamic_bsz``).
A mini-batch of rows with ``L_i`` real tokens each (prompt and response) is split into
``min(rows, ceil(sum L / budget))`` micro-batches (the largest count of any rank, so the ranks stay in step),
whose estimated costs ``24576 L + L^2`` (dense-layer and attention work, the reference's calibration for a
7B model) are balanced by the largest differencing method (Karmarkar and Karp 1982), rows ascending inside
each micro-batch. The micro-batches then run heaviest in the middle: ordered by cost (ties: first row)
descending, every other one reversed in front of the rest.

Why it matters here: STARE's reference code selects inside each micro-batch, and its micro-batch token mean
weighs micro-batches by their rows, so which rows share a micro-batch changes the update. The project's own
layout (``step.batch.micro_batches``) takes consecutive rows up to the budget instead.

Departure: the reference trainer also reorders the global batch across ranks before this (``balance_batch``);
here each rank partitions the rows it holds. Equal costs are ordered exactly as the reference orders them
(by sum, then size, then contents), so the partition is the same whenever the rows are.
"""

from __future__ import annotations

import heapq
import math

import torch
import torch.distributed as dist

from stare_lightning import distributed
from stare_lightning.step.batch import Rows

__all__ = ["balanced_micro_batches", "balanced_partition", "differencing_partition", "sequence_cost"]


def sequence_cost(length: int) -> int:
    """The reference trainer's estimate of a row's compute: linear layers plus attention, up to a constant."""
    return 24576 * length + length * length


class _Subset:
    """One part of a partial partition: its (index, value) members and their sum."""

    def __init__(self, members: list[tuple[int, int]] | None = None) -> None:
        self.members = list(members or [])
        self.total = sum(value for _, value in self.members)

    def key(self) -> tuple:
        return (self.total, len(self.members), self.members)


class _Partial:
    """k subsets kept heaviest first; the heap pops the partial partition with the widest spread first."""

    def __init__(self, subsets: list[_Subset]) -> None:
        self.subsets = sorted(subsets, key=_Subset.key, reverse=True)

    @property
    def spread(self) -> int:
        return self.subsets[0].total - self.subsets[-1].total

    def __lt__(self, other: _Partial) -> bool:
        if self.spread != other.spread:
            return self.spread > other.spread
        return self.subsets[0].key() > other.subsets[0].key()

    def absorb(self, other: _Partial) -> None:
        """Pair the heaviest subset here with the lightest there, and so on down: the differencing step."""
        k = len(self.subsets)
        merged = [_Subset(self.subsets[i].members + other.subsets[k - 1 - i].members) for i in range(k)]
        self.subsets = sorted(merged, key=_Subset.key, reverse=True)


def differencing_partition(values: list[int], parts: int) -> list[list[int]]:
    """Indices of ``values`` in ``parts`` groups of near-equal sums (largest differencing method), each sorted.

    Items enter smallest first, each as a partial partition of one non-empty subset; the two partial
    partitions of widest spread are merged until one is left.
    """
    if not 1 <= parts <= len(values):
        raise ValueError(f"cannot split {len(values)} items into {parts} non-empty parts")
    heap: list[_Partial] = []
    for value, index in sorted((value, index) for index, value in enumerate(values)):
        heapq.heappush(heap, _Partial([_Subset([(index, value)])] + [_Subset() for _ in range(parts - 1)]))
    while len(heap) > 1:
        first, second = heapq.heappop(heap), heapq.heappop(heap)
        first.absorb(second)
        heapq.heappush(heap, first)
    groups = [sorted(index for index, _ in subset.members) for subset in heap[0].subsets]
    if any(not group for group in groups):
        raise ValueError(f"the partition of {len(values)} items into {parts} parts left one empty")
    return groups


def balanced_partition(lengths: list[int], token_budget: int, count: int | None = None) -> list[list[int]]:
    """Row indices of each micro-batch, in the order they run (module docstring). ``count``: the number of
    micro-batches when it is already agreed (across ranks); at most one per row."""
    if count is None:
        count = math.ceil(sum(lengths) / token_budget)
    count = max(1, min(len(lengths), count))
    costs = [sequence_cost(length) for length in lengths]
    groups = differencing_partition(costs, count)
    groups.sort(key=lambda group: (sum(costs[i] for i in group), group[0]), reverse=True)
    return groups[::2][::-1] + groups[1::2]


def balanced_micro_batches(batch: Rows, token_budget: int, device: torch.device | None = None) -> list[Rows]:
    """``batch``'s rows in the reference trainer's micro-batches (``balanced_partition``); the count is the
    largest any rank needs, so every rank runs as many (a rank short of rows runs fillers, as usual)."""
    lengths = [int(n) for n in batch.attention_mask.sum(-1).tolist()]
    count = torch.tensor(float(min(len(lengths), math.ceil(sum(lengths) / token_budget))))
    count = int(distributed.all_reduce(count, dist.ReduceOp.MAX, device))
    groups = balanced_partition(lengths, token_budget, count)
    return [batch.select(torch.tensor(rows, device=batch.input_ids.device)).trimmed() for rows in groups]
