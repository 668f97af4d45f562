"""The same-batch entropy change: first order against autograd's directional derivative, and against the
realised change of small policy-gradient steps on a tabular softmax policy."""

from __future__ import annotations

import torch

from stare_lightning.algorithms.entropy_change import entropy_change


def entropy_of(z: torch.Tensor) -> torch.Tensor:
    p = torch.softmax(z, dim=-1)
    return -(p * torch.log(p)).sum(-1)


def test_first_order_is_the_directional_derivative_and_realised_is_exact():
    torch.manual_seed(0)
    before = torch.randn(3, 5, 11, dtype=torch.float64) * 2
    direction = torch.randn_like(before)
    after = before + 0.3 * direction
    realised, first = entropy_change(before, after, temperature=0.7, chunk_size=4)
    _, jvp = torch.func.jvp(lambda z: entropy_of(z / 0.7), (before,), (after - before,))
    assert torch.allclose(first.double(), jvp, atol=1e-5)
    assert torch.allclose(realised.double(), entropy_of(after / 0.7) - entropy_of(before / 0.7), atol=1e-5)
    shifted = entropy_change(before, before + 5.0)  # a constant shift of the logits changes nothing
    assert shifted[0].abs().max() < 1e-5 and shifted[1].abs().max() < 1e-5


def test_first_order_predicts_small_policy_gradient_steps_within_ten_percent():
    """A tabular softmax policy over 64 positions; one SGD step on -sum A log pi(o) with sampled tokens."""
    torch.manual_seed(1)
    logits = torch.randn(64, 20) * 1.5
    tokens = torch.distributions.Categorical(logits=logits).sample()
    advantages = torch.randn(64)
    for lr in (1e-3, 1e-2):
        z = logits.clone().requires_grad_(True)
        loss = -(advantages * torch.log_softmax(z, -1).gather(-1, tokens[:, None]).squeeze(-1)).sum()
        loss.backward()
        updated = (z - lr * z.grad).detach()
        realised, first = entropy_change(logits, updated)
        assert abs(realised.sum() - first.sum()) <= 0.1 * abs(realised.sum())
        assert realised.abs().sum() > 0  # the step moved the entropy
