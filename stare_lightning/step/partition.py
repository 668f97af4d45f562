"""Rows dealt to ranks and cut into micro-batches the way the reference trainer does: balanced by workload.

What it implements: two steps of the reference trainer (verl 0.7) that decide which rows train together.
Costs are ``24576 L + L^2`` for a row of ``L`` real tokens (prompt and response): dense-layer and attention
work, the reference's calibration for a 7B model. Both balance costs by the largest differencing method
(Karmarkar and Karp 1982).

- ``balance_batch`` (the driver, before any scoring): the step's rows over all ranks are split into one part of
  equal size per rank; each rank holds its part ordered by cost, the light rows at both ends and the heavy in
  the middle, and splits it into mini-batches in that order.
- dynamic batch size (the actor, per mini-batch): ``min(rows, ceil(sum L / budget))`` micro-batches (the
  largest count of any rank, so the ranks stay in step), rows ascending inside each, run heaviest in the
  middle: ordered by cost (ties: first row) descending, every other one reversed in front of the rest.

Why it matters here: STARE's reference code selects inside each micro-batch, and its micro-batch token mean
weighs micro-batches by their rows, so which rows share a micro-batch changes the update. The project's own
layout (``step.batch.micro_batches``) keeps each rank's rows and takes consecutive rows up to the budget.

Departure: the reference asserts that the step's rows divide evenly among the ranks; here a remainder is dealt
as rows of zero cost that are dropped afterwards, so rank sizes differ by at most one. Equal costs are ordered
exactly as the reference orders them (by sum, then size, then contents), so the result is the same whenever the
step's rows, in rank order, are.
"""

from __future__ import annotations

import heapq
import math

import torch
import torch.distributed as dist

from stare_lightning import distributed
from stare_lightning.step.batch import Rows, concatenate

__all__ = [
    "balanced_micro_batches",
    "balanced_partition",
    "balanced_rank_rows",
    "differencing_partition",
    "rank_partition",
    "sequence_cost",
]


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


def differencing_partition(values: list[int], parts: int, *, equal_size: bool = False) -> list[list[int]]:
    """Indices of ``values`` in ``parts`` groups of near-equal sums (largest differencing method), each sorted.

    Items enter smallest first, each as a partial partition of one non-empty subset (``equal_size``: the next
    ``parts`` items at a time, one per subset, so every group ends with ``len(values) / parts`` items); the two
    partial partitions of widest spread are merged until one is left.
    """
    if not 1 <= parts <= len(values):
        raise ValueError(f"cannot split {len(values)} items into {parts} non-empty parts")
    if equal_size and len(values) % parts:
        raise ValueError(f"cannot split {len(values)} items into {parts} parts of equal size")
    ordered = sorted((value, index) for index, value in enumerate(values))
    width = parts if equal_size else 1
    heap: list[_Partial] = []
    for start in range(0, len(ordered), width):
        subsets = [_Subset([(index, value)]) for value, index in ordered[start : start + width]]
        heapq.heappush(heap, _Partial(subsets + [_Subset() for _ in range(parts - len(subsets))]))
    while len(heap) > 1:
        first, second = heapq.heappop(heap), heapq.heappop(heap)
        first.absorb(second)
        heapq.heappush(heap, first)
    groups = [sorted(index for index, _ in subset.members) for subset in heap[0].subsets]
    if any(not group for group in groups):
        raise ValueError(f"the partition of {len(values)} items into {parts} parts left one empty")
    return groups


def rank_partition(lengths: list[int], ranks: int) -> list[list[int]]:
    """Indices of the step's rows (all ranks', in rank order) that each rank trains on, in the order it holds
    them: ``balance_batch`` of the module docstring. Needs at least one row per rank."""
    costs = [sequence_cost(length) for length in lengths]
    padded = costs + [0] * (-len(costs) % ranks)  # the remainder's stand-ins (module docstring, "Departure")
    parts = differencing_partition(padded, ranks, equal_size=True)
    dealt = []
    for part in parts:
        rows = sorted((row for row in part if row < len(costs)), key=lambda row: (costs[row], row))
        dealt.append(rows[::2] + rows[1::2][::-1])
    return dealt


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
    if not lengths:  # this rank holds none of the mini-batch's rows: it runs fillers only
        return []
    groups = balanced_partition(lengths, token_budget, count)
    return [batch.select(torch.tensor(rows, device=batch.input_ids.device)).trimmed() for rows in groups]


def balanced_rank_rows(batch: Rows, pad_token_id: int) -> Rows:
    """The rows this rank trains on after ``balance_batch`` over every rank's ``batch`` (``rank_partition``),
    in its order. On one process the rows are only reordered; with fewer rows than ranks nothing moves."""
    everyone = concatenate(distributed.all_gather_objects(batch.to("cpu")), pad_token_id=pad_token_id)
    ranks = distributed.world_size()
    if everyone.num_rows < ranks:
        return batch
    lengths = [int(n) for n in everyone.attention_mask.sum(-1).tolist()]
    mine = rank_partition(lengths, ranks)[distributed.rank()]
    return everyone.select(torch.tensor(mine, dtype=torch.long)).trimmed().to(batch.input_ids.device)
