"""Mismatch importance weights against a plain loop over tokens and sequences."""

from __future__ import annotations

import math

import pytest
import torch

from stare_lightning.algorithms.rollout_correction import mismatch_is_weights


def _reference(trainer, rollout, mask, level, mode, cap):
    """The definition, one token at a time in Python floats."""
    out = []
    for t_row, r_row, m_row in zip(trainer.tolist(), rollout.tolist(), mask.tolist()):
        seq_log_ratio = sum(t - r for t, r, m in zip(t_row, r_row, m_row) if m)
        row = []
        for t, r, m in zip(t_row, r_row, m_row):
            if not m:
                row.append(0.0)
                continue
            ratio = math.exp(seq_log_ratio if level == "sequence" else t - r)
            if mode == "truncate":
                row.append(min(ratio, cap))
            else:
                row.append(ratio if ratio <= cap else 0.0)
        out.append(row)
    return torch.tensor(out)


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("mode", ["truncate", "mask"])
@pytest.mark.parametrize("cap", [1.5, 2.0, 10.0])
def test_matches_loop_reference(level, mode, cap):
    gen = torch.Generator().manual_seed(0)
    trainer = -torch.rand(6, 9, generator=gen) * 3
    rollout = trainer + torch.randn(6, 9, generator=gen) * 0.4
    lengths = torch.tensor([9, 7, 5, 3, 1, 0])
    mask = (torch.arange(9)[None, :] < lengths[:, None]).long()
    weights = mismatch_is_weights(trainer, rollout, mask, level=level, mode=mode, cap=cap)
    torch.testing.assert_close(weights, _reference(trainer, rollout, mask, level, mode, cap), rtol=1e-5, atol=1e-6)
    assert (weights[mask == 0] == 0).all()
    if mode == "truncate":
        assert weights.max() <= cap


def test_identical_policies_give_unit_weights():
    lp = -torch.rand(3, 4)
    mask = torch.ones(3, 4)
    for level in ("token", "sequence"):
        torch.testing.assert_close(mismatch_is_weights(lp, lp.clone(), mask, level=level), torch.ones(3, 4))


def test_sequence_masking_drops_the_whole_response():
    trainer = torch.zeros(2, 3)
    rollout = torch.tensor([[0.0, -2.0, 0.0], [0.0, 0.1, 0.0]])  # row 0: ratio e^2 on one token
    weights = mismatch_is_weights(trainer, rollout, torch.ones(2, 3), level="sequence", mode="mask", cap=2.0)
    assert (weights[0] == 0).all()
    torch.testing.assert_close(weights[1], torch.full((3,), math.exp(-0.1)))


def test_weights_are_detached_and_finite_for_huge_ratios():
    trainer = torch.zeros(1, 50, requires_grad=True)
    rollout = torch.full((1, 50), -30.0)  # sequence log-ratio 1500
    weights = mismatch_is_weights(trainer, rollout, torch.ones(1, 50), level="sequence", mode="truncate", cap=2.0)
    assert not weights.requires_grad and torch.isfinite(weights).all() and (weights == 2.0).all()


def test_rejects_bad_shapes():
    # level, mode and cap are algorithm.mismatch_* settings, checked by AlgorithmConfig (test_algorithms_config.py).
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="shapes differ"):
        mismatch_is_weights(x, x, torch.ones(2, 4))
    with pytest.raises(ValueError, match=r"\[batch, time\]"):
        mismatch_is_weights(torch.zeros(6), torch.zeros(6), torch.ones(6))
