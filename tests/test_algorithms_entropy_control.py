"""Clip-Cov, KL-Cov, the 80/20 mask and the adaptive entropy coefficient against plain loops."""

import math

import pytest
import torch

from stare_lightning.algorithms import (
    AdaptiveEntropyCoefficient,
    clip_cov_mask,
    kl_cov_penalty,
    token_covariance,
    top_entropy_mask,
)


def batch(seed, B=6, T=12, adv_1d=True):
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 6
    old = lp + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = torch.rand(B, T, generator=g) > 0.25
    mask[2] = False
    adv = (
        torch.randn(B, generator=g, dtype=torch.float64) * 3
        if adv_1d
        else torch.randn(B, T, generator=g, dtype=torch.float64) * 3
    )
    return lp, old, adv, mask


def loop_cov(lp, adv, mask):
    cells = [(b, t) for b in range(lp.shape[0]) for t in range(lp.shape[1]) if mask[b, t]]
    a_of = (lambda b, t: float(adv[b])) if adv.dim() == 1 else (lambda b, t: float(adv[b, t]))
    n = max(len(cells), 1)
    mean_lp = sum(float(lp[b, t]) for b, t in cells) / n
    mean_a = sum(a_of(b, t) for b, t in cells) / n
    out = torch.zeros(lp.shape, dtype=torch.float64)
    for b, t in cells:
        out[b, t] = (float(lp[b, t]) - mean_lp) * (a_of(b, t) - mean_a)
    return out, cells


@pytest.mark.parametrize("adv_1d", [True, False])
def test_covariance_matches_loop(adv_1d):
    lp, _, adv, mask = batch(0, adv_1d=adv_1d)
    want, _ = loop_cov(lp, adv, mask)
    torch.testing.assert_close(token_covariance(lp, adv, mask), want)


@pytest.mark.parametrize("ratio", [1e-4, 0.05, 0.5, 1.0])
def test_clip_cov_mask_draws_from_the_band(ratio):
    lp, _, adv, mask = batch(1)
    cov, cells = loop_cov(lp, adv, mask)
    lb, ub = 0.5, 6.0
    exclude = torch.zeros_like(mask)
    exclude[0, :4] = True
    eligible = {(b, t) for b, t in cells if lb < cov[b, t] < ub and not exclude[b, t]}
    assert len(eligible) >= 3
    want_n = min(max(1, int(ratio * len(cells))), len(eligible))
    g = torch.Generator().manual_seed(3)
    out = clip_cov_mask(lp, adv, mask, clip_ratio=ratio, lb=lb, ub=ub, exclude=exclude, generator=g)
    chosen = {tuple(x) for x in out.nonzero().tolist()}
    assert chosen <= eligible and len(chosen) == want_n
    again = clip_cov_mask(
        lp, adv, mask, clip_ratio=ratio, lb=lb, ub=ub, exclude=exclude, generator=torch.Generator().manual_seed(3)
    )
    assert torch.equal(out, again)


def test_clip_cov_nothing_eligible_or_empty():
    lp, _, adv, mask = batch(2)
    assert not clip_cov_mask(lp, adv, mask, lb=1e6, ub=2e6).any()
    assert not clip_cov_mask(lp, adv, torch.zeros_like(mask)).any()
    # zero advantages: every covariance is 0, inside (-1, 1); the default ratio still detaches one token
    assert int(clip_cov_mask(lp, torch.zeros_like(adv), mask, lb=-1.0, ub=1.0).sum()) == 1


@pytest.mark.parametrize("ratio", [1e-3, 0.1, 1.0])
@pytest.mark.parametrize("adv_1d", [True, False])
def test_kl_cov_matches_loop(ratio, adv_1d):
    lp, old, adv, mask = batch(4, adv_1d=adv_1d)
    cov, cells = loop_cov(lp, adv, mask)
    k = max(1, int(ratio * len(cells)))
    order = sorted(range(len(cells)), key=lambda i: (-float(cov[cells[i]]), i))
    top = {cells[i] for i in order[:k]}
    want = torch.zeros(lp.shape, dtype=torch.float64)
    for b, t in top:
        want[b, t] = 0.7 * abs(float(lp[b, t] - old[b, t]))
    x = lp.clone().requires_grad_()
    penalty, selected = kl_cov_penalty(x, old, adv, mask, kl_cov_ratio=ratio, coef=0.7)
    torch.testing.assert_close(penalty.detach(), want)
    assert {tuple(v) for v in selected.nonzero().tolist()} == top
    penalty.sum().backward()
    assert (x.grad[~selected] == 0).all() and (x.grad[selected] != 0).all()


def test_top_entropy_mask_matches_loop_with_ties():
    g = torch.Generator().manual_seed(5)
    ent = torch.randint(0, 4, (5, 9), generator=g).float()  # many ties
    mask = torch.rand(5, 9, generator=g) > 0.3
    mask[0] = False
    for frac in (0.2, 0.5, 1.0, 1e-6):
        cells = [(b, t) for b in range(5) for t in range(9) if mask[b, t]]
        k = min(len(cells), max(1, math.ceil(frac * len(cells) - 1e-7)))
        order = sorted(range(len(cells)), key=lambda i: (-float(ent[cells[i]]), i))
        want = torch.zeros(5, 9, dtype=torch.bool)
        for i in order[:k]:
            want[cells[i]] = True
        assert torch.equal(top_entropy_mask(ent, mask, frac), want)
    assert not top_entropy_mask(ent, torch.zeros_like(mask)).any()


def test_adaptive_entropy_coefficient():
    c = AdaptiveEntropyCoefficient(target=0.5, init_coef=0.01, lr=0.01, min_coef=0.0, max_coef=0.03)
    assert c.update(0.2) == pytest.approx(0.02)
    assert c.update(torch.tensor(0.1)) == pytest.approx(0.03)
    assert c.update(0.1) == pytest.approx(0.03)  # clipped at max
    assert c.update(0.5) == pytest.approx(0.03)  # at target: unchanged
    for _ in range(10):
        c.update(0.9)
    assert c.coef == 0.0
    with pytest.warns(RuntimeWarning, match="non-finite"):
        assert c.update(float("nan")) == 0.0
    assert c.last_entropy == 0.9
    d = AdaptiveEntropyCoefficient(target=0.5, init_coef=0.02, lr=0.01, max_coef=0.03)
    d.load_state_dict(c.state_dict())
    assert d.state_dict() == c.state_dict() and d.update(0.1) == c.update(0.1)


@pytest.mark.parametrize(
    "call, name",
    [
        (lambda lp, o, a, m: token_covariance(lp[0], a, m[0]), "logprobs"),
        (lambda lp, o, a, m: clip_cov_mask(lp, a, m[:, :-1]), "mask"),
        (lambda lp, o, a, m: clip_cov_mask(lp, a, m, exclude=m[:, :-1]), "exclude"),
        (lambda lp, o, a, m: kl_cov_penalty(lp, o[:, :-1], a, m), "old_logprobs"),
        (lambda lp, o, a, m: kl_cov_penalty(lp, o, a[:-1], m), "advantages"),
        (lambda lp, o, a, m: top_entropy_mask(lp, m[:, :-1]), "mask"),
    ],
)
def test_shape_errors(call, name):
    # Scalar settings (ratios, bounds, coefficients) are checked by AlgorithmConfig (tests/test_algorithms_config.py).
    lp, old, adv, mask = batch(6)
    with pytest.raises(ValueError, match=name):
        call(lp, old, adv, mask)
