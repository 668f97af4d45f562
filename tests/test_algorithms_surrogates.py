"""Clipped surrogate, aggregation over micro-batches, KL estimators and entropy bonus against plain loops."""

import math

import pytest
import torch

from stare_lightning.algorithms import (
    LossNormalizer,
    aggregate_loss,
    clipped_surrogate,
    entropy_bonus,
    kl_penalty,
)

MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


def make_batch(seed, B=5, T=9, adv_1d=False, zero_adv=False):
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    old = lp + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.6  # ratios well past the clip ranges
    old[0, 0] = lp[0, 0] - 1.6  # ratio e^1.6 ~ 5 > c = 3
    mask = torch.rand(B, T, generator=g) > 0.25
    mask[1] = False  # an empty row
    mask[0, 0] = True
    adv = (
        torch.randn(B, generator=g, dtype=torch.float64)
        if adv_1d
        else torch.randn(B, T, generator=g, dtype=torch.float64)
    )
    if not adv_1d:
        adv[0, 0] = -abs(float(adv[0, 0])) - 0.1
    adv[2] = 0.0  # a tie group
    if zero_adv:
        adv = torch.zeros_like(adv)
    return lp, old, adv, mask


def loop_surrogate(lp, old, adv, mask, el, eh, c, weights):
    B, T = lp.shape
    out = torch.zeros(B, T, dtype=torch.float64)
    counts = {"low": 0, "high": 0, "dual": 0, "tokens": 0}
    for b in range(B):
        for t in range(T):
            if not mask[b, t]:
                continue
            a = float(adv[b]) if adv.dim() == 1 else float(adv[b, t])
            r = math.exp(min(max(float(lp[b, t] - old[b, t]), -20.0), 20.0))
            l1 = -a * r
            l2 = -a * min(max(r, 1 - el), 1 + eh)
            loss = max(l1, l2)
            if c is not None and a < 0:
                loss = min(loss, -a * c)
                counts["dual"] += r > c
            counts["low"] += a < 0 and r < 1 - el
            counts["high"] += a > 0 and r > 1 + eh
            counts["tokens"] += 1
            out[b, t] = loss * (1.0 if weights is None else float(weights[b, t]))
    return out, counts


@pytest.mark.parametrize("adv_1d", [False, True])
@pytest.mark.parametrize("zero_adv", [False, True])
@pytest.mark.parametrize("clip", [(0.2, 0.2, None), (0.2, 0.28, 3.0), (1.0, math.inf, None), (0.0, 0.0, 1.5)])
@pytest.mark.parametrize("weighted", [False, True])
def test_clipped_surrogate_matches_loop(adv_1d, zero_adv, clip, weighted):
    lp, old, adv, mask = make_batch(3, adv_1d=adv_1d, zero_adv=zero_adv)
    el, eh, c = clip
    weights = (
        0.5 + torch.rand(lp.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
        if weighted
        else None
    )
    got, st = clipped_surrogate(lp, old, adv, mask, eps_low=el, eps_high=eh, dual_clip_c=c, token_weights=weights)
    want, counts = loop_surrogate(lp, old, adv, mask, el, eh, c, weights)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert st.clip_low.item() == counts["low"]
    assert st.clip_high.item() == counts["high"]
    assert st.clip_dual.item() == counts["dual"]
    assert st.tokens.item() == counts["tokens"]
    if zero_adv:
        assert torch.count_nonzero(got) == 0
    if c is not None and not zero_adv and not adv_1d:
        assert st.clip_dual.item() >= 1


def test_masked_garbage_does_not_leak():
    lp, old, adv, mask = make_batch(4)
    lp = lp.clone()
    lp[~mask] = float("nan")
    lp.requires_grad_()
    loss, _ = clipped_surrogate(lp, old, adv, mask, eps_low=0.2, eps_high=0.2)
    assert torch.isfinite(loss).all() and (loss[~mask] == 0).all()
    aggregate_loss(loss, mask, "token-mean", LossNormalizer.from_mask(mask)).backward()
    assert torch.isfinite(lp.grad[mask]).all()


def test_weights_never_flip_gradient_sign():
    lp, old, adv, mask = make_batch(5)
    weights = torch.rand(lp.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * 2 + 0.05
    grads = []
    for wts in (None, weights):
        x = lp.clone().requires_grad_()
        loss, _ = clipped_surrogate(x, old, adv, mask, eps_low=0.2, eps_high=0.28, dual_clip_c=3.0, token_weights=wts)
        loss.sum().backward()
        grads.append(x.grad)
    assert torch.equal(torch.sign(grads[0]), torch.sign(grads[1]))
    torch.testing.assert_close(grads[1], grads[0] * weights)
    assert torch.count_nonzero(grads[0]) > 0


def loop_aggregate(loss, mask, mode, num_tokens, num_seqs, max_len):
    total = 0.0
    if mode == "seq-mean-token-mean":
        for b in range(loss.shape[0]):
            vals = [float(loss[b, t]) for t in range(loss.shape[1]) if mask[b, t]]
            if vals:
                total += sum(vals) / len(vals)
        return total / max(num_seqs, 1)
    for b in range(loss.shape[0]):
        for t in range(loss.shape[1]):
            if mask[b, t]:
                total += float(loss[b, t])
    if mode == "token-mean":
        return total / max(num_tokens, 1)
    return total / (max(num_seqs, 1) * max_len)


@pytest.mark.parametrize("mode", MODES)
def test_aggregate_matches_loop(mode):
    lp, old, adv, mask = make_batch(6)
    loss = torch.randn(lp.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    norm = LossNormalizer(num_tokens=37, num_sequences=11, max_response_length=16)
    got = aggregate_loss(loss, mask, mode, norm).item()
    assert got == pytest.approx(loop_aggregate(loss, mask, mode, 37, 11, 16), rel=1e-12)
    local = LossNormalizer.from_mask(mask, max_response_length=16)
    assert local.num_tokens == int(mask.sum()) and local.num_sequences == int(mask.any(-1).sum())
    got = aggregate_loss(loss, mask, mode, local).item()
    assert got == pytest.approx(loop_aggregate(loss, mask, mode, local.num_tokens, local.num_sequences, 16), rel=1e-12)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("split", [[1, 1, 1, 1, 1, 1, 1], [3, 4], [7], [2, 2, 3]])
def test_micro_batch_accumulation_equals_one_batch(mode, split):
    g = torch.Generator().manual_seed(7)
    B, T = 7, 12
    lengths = torch.randint(0, T + 1, (B,), generator=g)
    lengths[3] = 0  # an empty row
    mask = torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)
    lp = -torch.rand(B, T, generator=g)
    old = lp + 0.3 * torch.randn(B, T, generator=g)
    adv = torch.randn(B, generator=g)
    weights = 1 + torch.rand(B, T, generator=g)

    def loss_of(x, o, a, mk, wts, norm):
        per_tok, _ = clipped_surrogate(x, o, a, mk, eps_low=0.2, eps_high=0.28, dual_clip_c=3.0, token_weights=wts)
        return aggregate_loss(per_tok, mk, mode, norm)

    full_x = lp.clone().requires_grad_()
    norm = LossNormalizer.from_mask(mask, max_response_length=T)
    full = loss_of(full_x, old, adv, mask, weights, norm)
    full.backward()

    parts_x = lp.clone().requires_grad_()
    total = torch.zeros(())
    row = 0
    for size in split:
        rows = slice(row, row + size)
        t_i = max(int(lengths[rows].max()), 1)  # each micro-batch padded to its own length
        total = total + loss_of(
            parts_x[rows, :t_i], old[rows, :t_i], adv[rows], mask[rows, :t_i], weights[rows, :t_i], norm
        )
        row += size
    total.backward()
    assert abs(total.item() - full.item()) <= 1e-6
    torch.testing.assert_close(parts_x.grad, full_x.grad, rtol=0, atol=1e-6)


def test_aggregate_zero_counts_and_tensor_counts():
    loss = torch.ones(2, 3)
    empty = torch.zeros(2, 3, dtype=torch.bool)
    for mode in MODES:
        out = aggregate_loss(loss, empty, mode, LossNormalizer(0, 0, 5))
        assert out.item() == 0.0
    mask = torch.ones(2, 3, dtype=torch.bool)
    norm = LossNormalizer(torch.tensor(12.0), torch.tensor(4), 3)
    assert aggregate_loss(loss, mask, "token-mean", norm).item() == pytest.approx(0.5)
    assert aggregate_loss(loss, mask, "seq-mean-token-mean", norm).item() == pytest.approx(0.5)
    assert aggregate_loss(loss, mask, "seq-mean-token-sum-norm", norm).item() == pytest.approx(0.5)


def loop_kl(lp, ref, est):
    out = torch.zeros_like(lp)
    for idx in range(lp.numel()):
        d = float(ref.view(-1)[idx] - lp.view(-1)[idx])
        if est == "k1":
            out.view(-1)[idx] = -d
        elif est == "k2":
            out.view(-1)[idx] = 0.5 * d * d
        else:
            d = min(max(d, -20.0), 20.0)
            out.view(-1)[idx] = math.exp(d) - d - 1
    return out


@pytest.mark.parametrize("est", ["k1", "k2", "k3"])
def test_kl_matches_loop(est):
    g = torch.Generator().manual_seed(8)
    lp = -torch.rand(3, 6, generator=g, dtype=torch.float64) * 4
    ref = -torch.rand(3, 6, generator=g, dtype=torch.float64) * 4
    ref[0, 0] = lp[0, 0] + 30  # beyond the clamp
    torch.testing.assert_close(kl_penalty(lp, ref, est), loop_kl(lp, ref, est))
    if est in ("k2", "k3"):
        assert (kl_penalty(lp, ref, est) >= 0).all()
    assert torch.count_nonzero(kl_penalty(lp, lp.clone(), est)) == 0


def test_entropy_bonus():
    ent = torch.rand(2, 4)
    mask = torch.tensor([[1, 1, 0, 0], [0, 0, 0, 0]])
    out = entropy_bonus(ent, mask)
    assert torch.equal(out, torch.where(mask.bool(), ent, torch.zeros(())))


def test_shape_and_argument_errors():
    # Scalar ranges and choices (clip ranges, dual clip, loss_agg, kl_estimator) are checked by AlgorithmConfig
    # (tests/test_algorithms_config.py); the functions check shapes and missing inputs.
    z = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="max_response_length"):
        aggregate_loss(z, torch.ones(1, 2), "seq-mean-token-sum-norm", LossNormalizer(1, 1))
    with pytest.raises(ValueError, match="num_tokens"):
        LossNormalizer(torch.ones(2), 1)
    with pytest.raises(ValueError, match="mask"):
        aggregate_loss(z, torch.ones(1, 3), "token-mean", LossNormalizer(1, 1))
    with pytest.raises(ValueError, match="ref_logprobs"):
        kl_penalty(z, torch.zeros(2, 2))
    with pytest.raises(ValueError, match="advantages"):
        clipped_surrogate(z, z, torch.zeros(3), torch.ones(1, 2), eps_low=0.2, eps_high=0.2)
    with pytest.raises(ValueError, match="token_weights"):
        clipped_surrogate(
            z, z, torch.zeros(1), torch.ones(1, 2), eps_low=0.2, eps_high=0.2, token_weights=torch.ones(2, 2)
        )
