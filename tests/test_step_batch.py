"""The step's padded batch, the Experience built from it, micro-batches by token budget, and PPO mini-batch
splits (near-equal shuffled parts; per-rank splits that add up to the one-process split)."""

from __future__ import annotations

import pytest
import torch

from stare_lightning.rollout.base import Rollouts
from stare_lightning.step import Experience, build_rollout_batch, micro_batches, mini_batch_rows


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


PROMPTS = [[5, 6], [7], [8, 9, 10]]
RESPONSES = [[1, 2, 3], [4], []]


def _batch():
    rollouts = Rollouts(
        prompt_ids=PROMPTS,
        response_ids=RESPONSES,
        response_logprobs=[[-0.1 * (t + 1) for t in range(len(r))] for r in RESPONSES],
        texts=["a", "b", "c"],
        finish_reasons=["stop"] * 3,
        n=1,
    )
    return build_rollout_batch(rollouts, torch.tensor([1.0, 0.0, 0.5]), torch.tensor([0.5, -0.5, 0.0]), pad_token_id=0)


def test_rows_are_prompt_left_padded_then_response_right_padded():
    batch = _batch()
    assert batch.prompt_width == 3 and batch.response_width == 3
    for row, (prompt, response) in enumerate(zip(PROMPTS, RESPONSES)):
        ids = batch.input_ids[row].tolist()
        assert ids[3 - len(prompt) : 3] == prompt and ids[3 : 3 + len(response)] == response
        assert batch.attention_mask[row].sum() == len(prompt) + len(response)
        assert batch.response_mask[row].sum() == len(response)
        # positions count real tokens only: the first prompt token is position 0 whatever the padding
        assert batch.position_ids()[row, 3 - len(prompt)] == 0


def test_micro_batches_respect_the_budget_and_keep_every_row_once():
    batch = _batch()
    extra = torch.arange(9, dtype=torch.float32).view(3, 3)
    experience = Experience.build(batch, old_logprobs=extra, phi=-extra, stare_weights=None, stare_selected=None)
    parts = list(micro_batches(experience, token_budget=6))
    assert sum(p.num_rows for p in parts) == 3
    for part in parts:
        assert part.num_rows == 1 or part.num_rows * int(part.attention_mask.sum(-1).max()) <= 6
        # the loss inputs are sliced and trimmed together with the tokens
        assert part.old_logprobs.shape == part.response_mask.shape == part.phi.shape
    rows = torch.cat([p.old_logprobs[:, :1] for p in parts]).flatten()
    assert rows.tolist() == extra[:, 0].tolist()


def test_experience_is_built_complete_and_frozen():
    batch = _batch()
    experience = Experience.build(
        batch, old_logprobs=None, phi=None, stare_weights=torch.ones(3, 3), stare_selected=torch.ones(3, 3).bool()
    )
    assert torch.equal(experience.input_ids, batch.input_ids) and experience.prompt_width == batch.prompt_width
    with pytest.raises(AttributeError):
        experience.old_logprobs = torch.zeros(3, 3)
