"""PPO mini-batch splits: near-equal shuffled parts, and per-rank splits that add up to the one-process split."""

from __future__ import annotations

import pytest
import torch

from stare_lightning.experience import mini_batch_rows


def _split(num_rows, parts, seed=0, **kwargs):
    return mini_batch_rows(num_rows, parts, torch.Generator().manual_seed(seed), **kwargs)


@pytest.mark.parametrize("num_rows,parts", [(10, 1), (10, 3), (12, 4), (5, 8)])
def test_one_process_split_is_a_near_equal_partition(num_rows, parts):
    split = _split(num_rows, parts)
    assert len(split) == min(parts, num_rows)
    assert sorted(torch.cat(split).tolist()) == list(range(num_rows))
    sizes = [len(p) for p in split]
    assert max(sizes) - min(sizes) <= 1
    if parts == 1:
        assert split[0].tolist() == list(range(num_rows))  # on-policy order kept
    assert _split(num_rows, parts)[0].tolist() == split[0].tolist()  # same seed, same split


@pytest.mark.parametrize("counts,parts", [([3, 5, 0, 4], 3), ([8, 8], 4), ([1, 2], 5), ([6, 1], 4)])
def test_rank_splits_add_up_to_the_global_split(counts, parts):
    total = sum(counts)
    whole = [set(p.tolist()) for p in _split(total, parts, seed=7)]
    per_rank = []
    for rank, count in enumerate(counts):
        offset = sum(counts[:rank])
        split = _split(count, parts, seed=7, offset=offset, total_rows=total)
        assert all(((p >= 0) & (p < count)).all() for p in split)
        per_rank.append([set((p + offset).tolist()) for p in split])
    assert all(len(split) == len(whole) for split in per_rank), "every rank must take the same number of steps"
    for k, part in enumerate(whole):
        assert set().union(*(split[k] for split in per_rank)) == part


def test_rows_outside_the_global_batch_are_refused():
    with pytest.raises(ValueError, match="do not lie in a global batch of 6 rows"):
        _split(4, 2, offset=3, total_rows=6)
    with pytest.raises(ValueError, match="algorithm.mini_batches must be >= 1"):
        _split(4, 0)
