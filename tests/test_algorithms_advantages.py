"""Group advantages, zero-variance groups and the overlong penalty against plain loops."""

import math

import pytest
import torch

from stare_lightning.algorithms import compute_advantages, overlong_penalty, zero_variance_groups


def loop_advantages(rewards, estimator, eps):
    P, G = rewards.shape
    out = torch.zeros(P, G, dtype=torch.float64)
    for p in range(P):
        r = [float(x) for x in rewards[p]]
        mean = sum(r) / G
        for i in range(G):
            if estimator == "dr_grpo":
                out[p, i] = r[i] - mean
            elif estimator == "rloo":
                out[p, i] = r[i] - (sum(r) - r[i]) / (G - 1)
            else:
                std = math.sqrt(sum((x - mean) ** 2 for x in r) / (G - 1)) if G > 1 else 0.0
                out[p, i] = (r[i] - mean) / (std + eps) if G > 1 else 0.0
    return out


REWARD_CASES = [
    torch.tensor([[1.0, 0.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 1.0]]),  # incl. a tie group
    torch.zeros(2, 5),  # all-zero advantages
    torch.randn(4, 8, generator=torch.Generator().manual_seed(0)),
    torch.tensor([[0.3, -1.2]]),
]


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo"])
@pytest.mark.parametrize("case", range(len(REWARD_CASES)))
def test_advantages_match_loop(estimator, case):
    rewards = REWARD_CASES[case]
    got = compute_advantages(rewards, estimator, eps=1e-6)
    assert got.shape == rewards.shape
    torch.testing.assert_close(got.double(), loop_advantages(rewards, estimator, 1e-6), rtol=1e-5, atol=1e-6)


def test_grpo_uses_unbiased_std_and_zero_groups():
    adv = compute_advantages(torch.tensor([[1.0, 0.0]]), "grpo", eps=0.0)
    # unbiased std of {1, 0} is 1/sqrt(2): advantages +-1/sqrt(2)
    torch.testing.assert_close(adv, torch.tensor([[0.5 * math.sqrt(2), -0.5 * math.sqrt(2)]]))
    assert torch.equal(compute_advantages(torch.ones(3, 4)), torch.zeros(3, 4))
    assert torch.equal(compute_advantages(torch.tensor([[2.0], [3.0]]), "grpo"), torch.zeros(2, 1))
    assert compute_advantages(torch.ones(1, 2, dtype=torch.float64)).dtype == torch.float64


def test_advantage_value_errors():
    with pytest.raises(ValueError, match="algorithm.advantage.name='ppo' is not allowed"):
        compute_advantages(torch.zeros(1, 2), "ppo")
    with pytest.raises(ValueError, match="eps"):
        compute_advantages(torch.zeros(1, 2), eps=-1.0)
    with pytest.raises(ValueError, match="rewards"):
        compute_advantages(torch.zeros(4))
    with pytest.raises(ValueError, match="rloo"):
        compute_advantages(torch.zeros(3, 1), "rloo")


def test_zero_variance_groups_loop():
    g = torch.Generator().manual_seed(1)
    rewards = torch.randint(0, 2, (50, 4), generator=g).float()
    got = zero_variance_groups(rewards)
    want = torch.tensor([len(set(row.tolist())) == 1 for row in rewards])
    assert torch.equal(got, want)
    assert bool(want.any()) and not bool(want.all())


def loop_overlong(length, max_len, buffer, factor):
    expected = max_len - buffer
    if length <= expected:
        return 0.0
    if length > max_len:
        return -factor
    return -factor * (length - expected) / buffer


@pytest.mark.parametrize("max_len, buffer, factor", [(20, 4, 1.0), (20, 20, 0.5), (10, 0, 2.0), (7, 1, 1.0)])
def test_overlong_penalty_loop(max_len, buffer, factor):
    lengths = torch.arange(0, max_len + 4)
    got = overlong_penalty(lengths, max_len, buffer, factor)
    want = torch.tensor([loop_overlong(int(n), max_len, buffer, factor) for n in lengths])
    torch.testing.assert_close(got, want)
    assert float(got[lengths == max_len].item()) == pytest.approx(-factor if buffer > 0 else 0.0)


def test_overlong_value_errors():
    n = torch.tensor([1, 2])
    with pytest.raises(ValueError, match="max_response_length"):
        overlong_penalty(n, 0, 0)
    with pytest.raises(ValueError, match="buffer_length"):
        overlong_penalty(n, 10, 11)
    with pytest.raises(ValueError, match="buffer_length"):
        overlong_penalty(n, 10, -1)
    with pytest.raises(ValueError, match="penalty_factor"):
        overlong_penalty(n, 10, 2, -0.5)
