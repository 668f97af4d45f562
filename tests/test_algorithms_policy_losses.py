"""GSPO and CISPO against loop references written from their papers' formulas, with and without STARE's weights,
and the registries that make a new loss, estimator or entropy control a function plus a name."""

from __future__ import annotations

import math

import pytest
import torch

from stare_lightning.algorithms import AlgorithmConfig, LossNormalizer, LossSpec, aggregate_loss, policy_loss
from stare_lightning.algorithms.advantages import ADVANTAGE_ESTIMATORS, compute_advantages
from stare_lightning.algorithms.policy_losses import POLICY_LOSSES, ClipRange
from stare_lightning.algorithms.registry import Registry


def _batch(seed: int = 0, spread: float = 0.3):
    g = torch.Generator().manual_seed(seed)
    lengths = [5, 3, 7, 1, 6, 4]
    mask = torch.zeros(len(lengths), 8, dtype=torch.bool)
    for row, n in enumerate(lengths):
        mask[row, :n] = True
    old = -torch.rand(mask.shape, generator=g, dtype=torch.float64) * 3
    current = (old + spread * torch.randn(mask.shape, generator=g, dtype=torch.float64)).requires_grad_(True)
    advantages = torch.tensor([1.2, -0.7, 0.4, -1.5, 0.9, -0.2], dtype=torch.float64)
    omega = torch.where(torch.rand(mask.shape, generator=g) < 0.3, 1.5, 1.0).double()
    return current, old, advantages, mask, omega


def _gspo_reference(current, old, advantages, mask, low, high, omega=None):
    """Zheng et al. 2025, eq. (5)-(7): per sequence s_i = (pi/pi_old)^(1/|y_i|); objective mean_i min(s_i A_i,
    clip(s_i) A_i). With token weights, sequence i's gradient is s_i A_i mean_t(omega_t grad log pi_t) where the
    clip is inactive, and 0 where it is active: written as a loss whose value is the sequence objective's."""
    total = 0.0
    for i in range(current.shape[0]):
        tokens = mask[i].nonzero().squeeze(1).tolist()
        if not tokens:
            continue
        log_s = sum(current[i, t] - old[i, t] for t in tokens) / len(tokens)
        s = torch.exp(log_s)
        a = advantages[i]
        unclipped, clipped = s * a, s.clamp(1 - low, 1 + high) * a
        objective = torch.minimum(unclipped, clipped)
        if omega is not None:
            active = bool(clipped < unclipped)  # the min picks the clipped branch: no gradient
            weighted = sum(omega[i, t] * (current[i, t] - current[i, t].detach()) for t in tokens) / len(tokens)
            surrogate = objective.detach() + (0.0 if active else s.detach() * a * weighted)
            total = total - surrogate
        else:
            total = total - objective
    return total / sum(1 for i in range(current.shape[0]) if mask[i].any())


def _loss_and_gradient(name, batch, clip, aggregation, weights):
    """The registered loss ``name`` aggregated over ``batch``: (loss, its gradient in the log-probs, clip counts)."""
    current, old, advantages, mask = batch
    per_token, stats = POLICY_LOSSES[name](current, old, advantages, mask, clip, token_weights=weights)
    loss = aggregate_loss(per_token, mask, aggregation, LossNormalizer.from_mask(mask))
    (grad,) = torch.autograd.grad(loss, current)
    return loss, grad, stats


@pytest.mark.parametrize("weighted", [False, True])
def test_gspo_is_the_sequence_level_objective(weighted):
    current, old, advantages, mask, omega = _batch(spread=0.05)
    low, high = 0.02, 0.03  # some sequences clipped, some not, at this spread
    weights = omega if weighted else None
    batch = (current, old, advantages, mask)
    loss, grad, stats = _loss_and_gradient("gspo", batch, ClipRange(low, high), "seq-mean-token-mean", weights)
    want = _gspo_reference(current, old, advantages, mask, low, high, weights)
    (want_grad,) = torch.autograd.grad(want, current)
    if not weighted:
        assert float(loss) == pytest.approx(float(want.detach()), abs=1e-12)
    assert torch.allclose(grad, want_grad, atol=1e-12)
    assert 0 < float(stats.clip_low + stats.clip_high) < float(stats.tokens)  # the clip was exercised both ways


def _cispo_reference(current, old, advantages, mask, low, high, omega=None):
    """MiniMax 2025, eq. (4): -1/sum|o_i| sum_i sum_t sg(clip(r_it, 1 - eps_low, 1 + eps_high)) A_i log pi_it."""
    total, tokens = 0.0, 0
    for i in range(current.shape[0]):
        for t in mask[i].nonzero().squeeze(1).tolist():
            r = math.exp(float(current[i, t] - old[i, t]))
            weight = min(max(r, 1 - low), 1 + high) * (float(omega[i, t]) if omega is not None else 1.0)
            total = total - weight * advantages[i] * current[i, t]
            tokens += 1
    return total / tokens


@pytest.mark.parametrize("weighted", [False, True])
def test_cispo_keeps_every_token_and_clips_only_the_weight(weighted):
    current, old, advantages, mask, omega = _batch(spread=0.4)
    low, high = 1.0, 0.2
    weights = omega if weighted else None
    batch = (current, old, advantages, mask)
    loss, grad, stats = _loss_and_gradient("cispo", batch, ClipRange(low, high), "token-mean", weights)
    want = _cispo_reference(current, old, advantages, mask, low, high, weights)
    (want_grad,) = torch.autograd.grad(want, current)
    assert float(loss) == pytest.approx(float(want.detach()), abs=1e-12)
    assert torch.allclose(grad, want_grad, atol=1e-12)
    assert float(stats.clip_high) > 0 and (grad[mask] != 0).all()  # clipped weights, yet every token has gradient


def test_policy_loss_dispatches_by_name_and_refuses_what_a_loss_cannot_do():
    current, old, advantages, mask, _ = _batch()
    normalizer = LossNormalizer.from_mask(mask)
    cfg = AlgorithmConfig(policy_loss={"name": "cispo", "clip_eps_low": 1.0, "clip_eps_high": 0.2})
    loss, _ = policy_loss(current, old, advantages, mask, LossSpec.of(cfg), normalizer)
    assert float(loss) == pytest.approx(float(_cispo_reference(current, old, advantages, mask, 1.0, 0.2)), abs=1e-12)
    with pytest.raises(ValueError, match="dual_clip_c=10.0 does nothing with algorithm.policy_loss.name=gspo"):
        AlgorithmConfig(policy_loss={"name": "gspo", "dual_clip_c": 10.0})
    with pytest.raises(ValueError, match="entropy_control.name=clip_cov is defined on PPO's token clip"):
        AlgorithmConfig(policy_loss={"name": "cispo"}, entropy_control={"name": "clip_cov"})
    with pytest.raises(
        ValueError, match=r"policy_loss.name='sapo' is not allowed: choose one of \['ppo', 'gspo', 'cispo'"
    ):
        AlgorithmConfig(policy_loss={"name": "sapo"})


def test_a_registered_estimator_is_a_config_value_at_once():
    registry = Registry("algorithm.thing")
    registry.register("first")(len)
    with pytest.raises(ValueError, match="registered twice"):
        registry.register("first")(len)
    name = "median_baseline"
    try:
        ADVANTAGE_ESTIMATORS.register(name)(lambda r, eps: r - r.median(dim=1, keepdim=True).values)
        assert AlgorithmConfig(advantage={"name": name}).advantage.name == name
        rewards = torch.tensor([[0.0, 1.0, 1.0]])
        assert compute_advantages(rewards, name).tolist() == [[-1.0, 0.0, 0.0]]
    finally:
        ADVANTAGE_ESTIMATORS._entries.pop(name, None)
