"""Entropy sensitivity Phi against finite differences, autograd and a toy softmax policy."""

import math

import pytest
import torch

from stare_lightning.algorithms import (
    entropy_sensitivity,
    predicted_entropy_change,
    stare_token_weights,
    token_stats_from_logits,
)


def entropy_of(z):
    logp = torch.log_softmax(z, dim=-1)
    return -(logp.exp() * logp).sum(-1)


def phi_loop(z, o):
    """First form of the method doc: pi_o (s_o - H) - sum_j pi_j^2 (s_j - H), one position, float64."""
    m = max(float(v) for v in z)
    lse = m + math.log(sum(math.exp(float(v) - m) for v in z))
    p = [math.exp(float(v) - lse) for v in z]
    s = [lse - float(v) for v in z]
    H = sum(pj * sj for pj, sj in zip(p, s))
    return p[o] * (s[o] - H) - sum(pj * pj * (sj - H) for pj, sj in zip(p, s))


def phi_from_stats(logits, targets):
    st = token_stats_from_logits(logits, targets, with_sensitivity=True)
    return entropy_sensitivity(st.logprobs, st.entropy, st.sum_p2, st.sum_p2_logp)


@pytest.mark.parametrize("V", [2, 7, 50])
def test_phi_matches_loop_formula(V):
    g = torch.Generator().manual_seed(V)
    logits = torch.randn(3, 4, V, dtype=torch.float64, generator=g) * 3
    targets = torch.randint(0, V, (3, 4), generator=g)
    phi = phi_from_stats(logits, targets)
    for b in range(3):
        for t in range(4):
            assert phi[b, t].item() == pytest.approx(phi_loop(logits[b, t], int(targets[b, t])), rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("V", [3, 10, 100])
def test_phi_is_the_entropy_change_of_a_logit_step(V):
    """Apply dz = eta * A * (e_o - pi) at one position and measure dH: equals eta * A * Phi to 1e-4 relative."""
    g = torch.Generator().manual_seed(100 + V)
    eta = 1e-6
    checked = 0
    for _ in range(20):
        z = torch.randn(V, dtype=torch.float64, generator=g) * 2.5
        o = int(torch.randint(0, V, (1,), generator=g))
        A = float(torch.randn(1, generator=g, dtype=torch.float64))
        pi = torch.softmax(z, -1)
        e_o = torch.zeros(V, dtype=torch.float64)
        e_o[o] = 1
        dz = eta * A * (e_o - pi)
        realised = (entropy_of(z + dz) - entropy_of(z - dz)).item() / 2  # central difference
        phi = phi_from_stats(z.view(1, 1, V), torch.tensor([[o]])).item()
        predicted = eta * A * phi
        if abs(predicted) < 1e-13:
            continue  # both vanish; the relative test is meaningless there
        assert realised == pytest.approx(predicted, rel=1e-4)
        # and exactly the directional derivative by autograd
        zz = z.clone().requires_grad_()
        (grad,) = torch.autograd.grad(entropy_of(zz), zz)
        assert (grad @ (e_o - pi)).item() == pytest.approx(phi, rel=1e-9, abs=1e-14)
        checked += 1
    assert checked >= 15


def test_phi_sign_structure_and_zero_mean():
    g = torch.Generator().manual_seed(7)
    z = torch.randn(1, 1, 20, dtype=torch.float64, generator=g) * 2
    pi = torch.softmax(z[0, 0], -1)
    H = entropy_of(z[0, 0])
    phis = torch.stack([phi_from_stats(z, torch.tensor([[o]]))[0, 0] for o in range(20)])
    # tokens with surprisal >= H raise entropy when reinforced
    surprisal = -torch.log(pi)
    assert bool((phis[surprisal >= H] > 0).all())
    # E_{o ~ pi}[Phi] = 0 ("near-criticality")
    assert abs((pi * phis).sum().item()) < 1e-12


@pytest.mark.parametrize("use_weights", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_toy_softmax_policy_step(use_weights, seed):
    """A tabular categorical policy, one SGD step on -sum(omega * A * log pi(o)): prediction within 10%."""
    g = torch.Generator().manual_seed(seed)
    n_pos, V = 64, 12
    z0 = torch.randn(n_pos, V, dtype=torch.float64, generator=g) * 2
    o = torch.multinomial(torch.softmax(z0, -1), 1, generator=g).squeeze(1)
    A = torch.randn(n_pos, dtype=torch.float64, generator=g)
    mask = torch.ones(1, n_pos, dtype=torch.bool)
    st = token_stats_from_logits(z0.unsqueeze(0), o.unsqueeze(0), with_sensitivity=True)
    phi = entropy_sensitivity(st.logprobs, st.entropy, st.sum_p2, st.sum_p2_logp)
    weights = None
    if use_weights:
        weights, _ = stare_token_weights(st.logprobs, A.unsqueeze(0), mask, variant="C2", top_ratio=0.3, w=1.5, m=0.5)
        weights = weights.double()
    omega = torch.ones(n_pos, dtype=torch.float64) if weights is None else weights[0]

    lr = 0.005
    z = z0.clone().requires_grad_()
    logp = torch.log_softmax(z, -1).gather(1, o.unsqueeze(1)).squeeze(1)
    loss = -(omega * A * logp).sum()
    loss.backward()
    with torch.no_grad():
        z1 = z - lr * z.grad
    realised = (entropy_of(z1).mean() - entropy_of(z0).mean()).item()
    predicted = predicted_entropy_change(phi, A.unsqueeze(0), weights, mask, step_size=lr).item()
    assert predicted != 0 and math.copysign(1, predicted) == math.copysign(1, realised)
    assert abs(predicted - realised) <= 0.1 * abs(realised)

    # the same step expressed through a token-mean loss: step_size = lr / N
    z = z0.clone().requires_grad_()
    logp = torch.log_softmax(z, -1).gather(1, o.unsqueeze(1)).squeeze(1)
    (-(omega * A * logp).mean()).backward()
    with torch.no_grad():
        z2 = z - (lr * n_pos) * z.grad
    torch.testing.assert_close(z2, z1)


def loop_predicted(phi, adv, weights, mask, eta, num_tokens=None):
    total, n = 0.0, 0
    for b in range(phi.shape[0]):
        for t in range(phi.shape[1]):
            if mask[b, t]:
                a = adv[b] if adv.dim() == 1 else adv[b, t]
                wgt = 1.0 if weights is None else float(weights[b, t])
                total += wgt * float(a) * float(phi[b, t])
                n += 1
    denom = num_tokens if num_tokens is not None else max(n, 1)
    return eta * total / denom


@pytest.mark.parametrize("adv_1d", [False, True])
def test_predicted_change_matches_loop(adv_1d):
    g = torch.Generator().manual_seed(11)
    phi = torch.randn(4, 6, generator=g)
    phi[0, 0] = float("nan")  # a masked position holding garbage must not leak
    mask = torch.rand(4, 6, generator=g) > 0.3
    mask[0, 0] = False
    mask[2] = False  # an empty row
    adv = torch.randn(4, generator=g) if adv_1d else torch.randn(4, 6, generator=g)
    weights = 1 + torch.rand(4, 6, generator=g)
    for wts in (None, weights):
        got = predicted_entropy_change(phi, adv, wts, mask, 0.3).item()
        assert got == pytest.approx(loop_predicted(phi, adv, wts, mask, 0.3), rel=1e-5, abs=1e-7)
    got = predicted_entropy_change(phi, adv, None, mask, 0.3, num_tokens=100).item()
    assert got == pytest.approx(loop_predicted(phi, adv, None, mask, 0.3, num_tokens=100), rel=1e-5)
    assert predicted_entropy_change(phi, adv, None, torch.zeros(4, 6, dtype=torch.bool), 1.0).item() == 0.0
    assert predicted_entropy_change(phi, torch.zeros(4), None, mask, 1.0).item() == 0.0


def test_predicted_change_value_errors():
    phi, mask = torch.zeros(1, 2), torch.ones(1, 2)
    with pytest.raises(ValueError, match="step_size"):
        predicted_entropy_change(phi, torch.zeros(1), None, mask, float("inf"))
    with pytest.raises(ValueError, match="num_tokens"):
        predicted_entropy_change(phi, torch.zeros(1), None, mask, 1.0, num_tokens=0)
