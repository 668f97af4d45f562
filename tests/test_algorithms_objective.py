"""policy_loss: equals plain GRPO with unit weights, composes its terms as documented, accumulates exactly."""

import math

import pytest
import torch

from stare_lightning.algorithms import (
    AlgorithmConfig,
    LossNormalizer,
    LossSpec,
    policy_loss,
)
from tests.test_algorithms_stare import one_part_weights

MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


def batch(seed, B=6, T=10, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, T + 1, (B,), generator=g)
    lengths[0], lengths[1] = T, 0  # a full row and an empty row
    mask = torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)
    lp = -torch.rand(B, T, generator=g, dtype=dtype) * 3
    old = lp + 0.4 * torch.randn(B, T, generator=g, dtype=dtype)
    ref = lp + 0.5 * torch.randn(B, T, generator=g, dtype=dtype)
    ent = torch.rand(B, T, generator=g, dtype=dtype) * 2
    adv = torch.randn(B, generator=g, dtype=dtype)
    adv[2] = 0.0
    return lp, old, ref, ent, adv, mask


def loop_grpo(lp, old, adv, mask, eps_low, eps_high, c, mode, max_len):
    """Plain GRPO/PPO loss over one batch, one token at a time."""
    per_seq, total, n_tok, n_seq = [], 0.0, 0, 0
    for b in range(lp.shape[0]):
        seq = []
        for t in range(lp.shape[1]):
            if not mask[b, t]:
                continue
            a = float(adv[b])
            r = math.exp(float(lp[b, t] - old[b, t]))
            loss = max(-a * r, -a * min(max(r, 1 - eps_low), 1 + eps_high))
            if c is not None and a < 0:
                loss = min(loss, -a * c)
            seq.append(loss)
        if seq:
            n_seq += 1
            per_seq.append(sum(seq) / len(seq))
        total += sum(seq)
        n_tok += len(seq)
    if mode == "token-mean":
        return total / n_tok
    if mode == "seq-mean-token-mean":
        return sum(per_seq) / n_seq
    return total / (n_seq * max_len)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dual", [None, 3.0])
def test_unit_weights_are_plain_grpo(mode, dual):
    lp, old, ref, ent, adv, mask = batch(0)
    cfg = AlgorithmConfig(update={"loss_agg": mode}, policy_loss={"clip_eps_high": 0.28, "dual_clip_c": dual})
    norm = LossNormalizer.from_mask(mask, max_response_length=10)
    plain, _ = policy_loss(lp, old, adv, mask, LossSpec.of(cfg), norm)
    ones, _ = policy_loss(lp, old, adv, mask, LossSpec.of(cfg), norm, token_weights=torch.ones_like(lp))
    gate_off, _ = one_part_weights(lp, adv, mask, scope="step", gate_on=False)
    off, _ = policy_loss(lp, old, adv, mask, LossSpec.of(cfg), norm, token_weights=gate_off.to(lp.dtype))
    assert torch.equal(plain, ones) and torch.equal(plain, off)
    assert plain.item() == pytest.approx(loop_grpo(lp, old, adv, mask, 0.2, 0.28, dual, mode, 10), rel=1e-12)


def test_stare_weights_never_flip_gradient_signs():
    lp, old, ref, ent, adv, mask = batch(1)
    cfg = AlgorithmConfig(policy_loss={"clip_eps_high": 0.28, "dual_clip_c": 3.0})
    norm = LossNormalizer.from_mask(mask)
    weights, st = one_part_weights(lp, adv, mask, scope="step", variant="C2", top_ratio=0.5, w=1.5, m=0.5)
    assert st.selected_pos.item() > 0 and st.selected_neg.item() > 0
    grads = []
    for wts in (None, weights.to(lp.dtype)):
        x = lp.clone().requires_grad_()
        loss, _ = policy_loss(x, old, adv, mask, LossSpec.of(cfg), norm, token_weights=wts)
        loss.backward()
        grads.append(x.grad)
    assert torch.equal(torch.sign(grads[0]), torch.sign(grads[1]))
    torch.testing.assert_close(grads[1], grads[0] * weights.to(lp.dtype))


@pytest.mark.parametrize("mode", MODES)
def test_kl_and_entropy_terms(mode):
    lp, old, ref, ent, adv, mask = batch(2)
    norm = LossNormalizer.from_mask(mask, max_response_length=10)
    base, _ = policy_loss(lp, old, adv, mask, LossSpec.of(AlgorithmConfig(update={"loss_agg": mode})), norm)
    cfg = AlgorithmConfig(update={"loss_agg": mode}, kl={"coef": 0.3, "estimator": "k3"}, entropy_bonus={"coef": 0.05})
    loss, stats = policy_loss(lp, old, adv, mask, LossSpec.of(cfg), norm, ref_logprobs=ref, entropy=ent)
    kl_tok = torch.exp(ref - lp) - (ref - lp) - 1

    def agg(q):  # the same aggregation of a per-token quantity, written out
        if mode == "token-mean":
            return q[mask].sum() / mask.sum()
        if mode == "seq-mean-token-mean":
            rows = [q[b][mask[b]].mean() for b in range(q.shape[0]) if mask[b].any()]
            return sum(rows) / len(rows)
        return q[mask].sum() / (mask.any(-1).sum() * 10)

    want = base + 0.3 * agg(kl_tok) - 0.05 * agg(ent)
    assert loss.item() == pytest.approx(want.item(), rel=1e-12)
    assert stats["kl_sum"].item() == pytest.approx(kl_tok[mask].sum().item(), rel=1e-6)
    assert stats["entropy_sum"].item() == pytest.approx(ent[mask].sum().item(), rel=1e-6)
    # entropy_coef override and cfg.entropy_coef default
    loss2, _ = policy_loss(lp, old, adv, mask, LossSpec.of(cfg), norm, ref_logprobs=ref, entropy=ent, entropy_coef=0.0)
    assert loss2.item() == pytest.approx((base + 0.3 * agg(kl_tok)).item(), rel=1e-12)


def test_entropy_bonus_gradient_flows_to_entropy():
    lp, old, ref, ent, adv, mask = batch(3)
    e = ent.clone().requires_grad_()
    cfg = AlgorithmConfig(entropy_bonus={"coef": 0.1})
    loss, _ = policy_loss(lp, old, adv, mask, LossSpec.of(cfg), LossNormalizer.from_mask(mask), entropy=e)
    loss.backward()
    expect = torch.where(mask, torch.full_like(ent, -0.1 / mask.sum().item()), torch.zeros_like(ent))
    torch.testing.assert_close(e.grad, expect)


@pytest.mark.parametrize("mode", MODES)
def test_micro_batches_with_global_counts_equal_one_batch(mode):
    lp, old, ref, ent, adv, mask = batch(4, B=8, T=12, dtype=torch.float32)
    cfg = AlgorithmConfig(
        update={"loss_agg": mode},
        policy_loss={"clip_eps_high": 0.28, "dual_clip_c": 3.0},
        kl={"coef": 0.1},
        entropy_bonus={"coef": 0.01},
    )
    weights, _ = one_part_weights(lp, adv, mask, scope="step", variant="C2", top_ratio=0.3)
    norm = LossNormalizer.from_mask(mask, max_response_length=12)
    x = lp.clone().requires_grad_()
    full, full_stats = policy_loss(
        x, old, adv, mask, LossSpec.of(cfg), norm, token_weights=weights, ref_logprobs=ref, entropy=ent
    )
    full.backward()
    y = lp.clone().requires_grad_()
    total, sums = torch.zeros(()), {}
    for rows in (slice(0, 3), slice(3, 4), slice(4, 8)):
        t_i = max(int(mask[rows].sum(-1).max()), 1)
        part, stats = policy_loss(
            y[rows, :t_i],
            old[rows, :t_i],
            adv[rows],
            mask[rows, :t_i],
            LossSpec.of(cfg),
            norm,
            token_weights=weights[rows, :t_i],
            ref_logprobs=ref[rows, :t_i],
            entropy=ent[rows, :t_i],
        )
        total = total + part
        for k, v in stats.items():
            sums[k] = sums.get(k, 0.0) + v
    total.backward()
    assert abs(total.item() - full.item()) <= 1e-6
    torch.testing.assert_close(y.grad, x.grad, rtol=0, atol=1e-6)
    for k in ("tokens", "clip_low", "clip_high", "clip_dual", "kl_sum", "entropy_sum", "weight_sum", "ratio_sum"):
        assert float(sums[k]) == pytest.approx(float(full_stats[k]), rel=1e-5), k
    assert float(sums["pg_loss"]) == pytest.approx(float(full_stats["pg_loss"]), abs=1e-6)


def test_stats_are_sums_over_valid_tokens():
    lp, old, ref, ent, adv, mask = batch(5)
    cfg = AlgorithmConfig(policy_loss={"clip_eps_high": 0.28, "dual_clip_c": 3.0})
    _, stats = policy_loss(lp, old, adv, mask, LossSpec.of(cfg), LossNormalizer.from_mask(mask))
    r = torch.exp(lp - old)
    a = adv.unsqueeze(1).expand_as(lp)
    assert stats["tokens"].item() == mask.sum().item()
    assert stats["clip_low"].item() == (mask & (a < 0) & (r < 0.8)).sum().item()
    assert stats["clip_high"].item() == (mask & (a > 0) & (r > 1.28)).sum().item()
    assert stats["clip_dual"].item() == (mask & (a < 0) & (r > 3.0)).sum().item()
    assert stats["ratio_sum"].item() == pytest.approx(r[mask].sum().item(), rel=1e-6)
    assert all(not v.requires_grad for v in stats.values())


def test_clip_cov_detaches_gradients_but_keeps_value():
    lp, old, ref, ent, adv, mask = batch(6)
    adv = adv * 5
    adv[2] = 1.5  # every valid token then has a nonzero gradient to lose
    norm = LossNormalizer.from_mask(mask)
    cfg = AlgorithmConfig(entropy_control={"name": "clip_cov", "clip_cov": {"ratio": 0.2, "lb": -100.0, "ub": 100.0}})
    x = lp.clone().requires_grad_()
    loss, stats = policy_loss(x, old, adv, mask, LossSpec.of(cfg), norm, generator=torch.Generator().manual_seed(0))
    loss.backward()
    base_x = lp.clone().requires_grad_()
    base, _ = policy_loss(base_x, old, adv, mask, LossSpec.of(AlgorithmConfig()), norm)
    base.backward()
    assert loss.item() == pytest.approx(base.item(), rel=1e-12)
    changed = x.grad != base_x.grad
    assert changed.sum().item() == stats["controlled"].item() == max(1, int(0.2 * mask.sum().item()))
    assert (x.grad[changed] == 0).all()


def test_top_entropy_keeps_gradient_only_on_top_tokens():
    lp, old, ref, ent, adv, mask = batch(7)
    norm = LossNormalizer.from_mask(mask)
    cfg = AlgorithmConfig(entropy_control={"name": "top_entropy", "top_entropy": {"fraction": 0.2}})
    x = lp.clone().requires_grad_()
    loss, stats = policy_loss(x, old, adv, mask, LossSpec.of(cfg), norm, entropy=ent)
    loss.backward()
    n = int(mask.sum())
    k = math.ceil(0.2 * n)
    threshold = torch.sort(ent[mask], descending=True).values[k - 1]
    nonzero = x.grad != 0
    assert (ent[nonzero] >= threshold).all()
    assert stats["controlled"].item() == n - k
    with pytest.raises(ValueError, match="entropy"):
        policy_loss(lp, old, adv, mask, LossSpec.of(cfg), norm)


def test_kl_cov_is_unclipped_surrogate_plus_penalty():
    lp, old, ref, ent, adv, mask = batch(8)
    norm = LossNormalizer.from_mask(mask)
    cfg = AlgorithmConfig(entropy_control={"name": "kl_cov", "kl_cov": {"ratio": 0.3, "coef": 2.0}})
    loss, stats = policy_loss(lp, old, adv, mask, LossSpec.of(cfg), norm)
    a = adv.unsqueeze(1).expand_as(lp)
    unclipped = (-a * torch.exp(lp - old))[mask].sum()
    lp_c = lp - lp[mask].mean()
    cov = torch.where(mask, lp_c * (a - a[mask].mean()), torch.full_like(lp, -math.inf))
    k = max(1, int(0.3 * mask.sum().item()))
    top = torch.topk(cov.flatten(), k).indices
    penalty = 2.0 * (lp - old).abs().flatten()[top].sum()
    assert loss.item() == pytest.approx(((unclipped + penalty) / mask.sum()).item(), rel=1e-10)
    assert stats["controlled"].item() == k


def test_value_errors():
    lp, old, ref, ent, adv, mask = batch(9)
    norm = LossNormalizer.from_mask(mask)
    with pytest.raises(ValueError, match="ref_logprobs"):
        policy_loss(lp, old, adv, mask, LossSpec.of(AlgorithmConfig(kl={"coef": 0.1})), norm)
    with pytest.raises(ValueError, match="entropy"):
        policy_loss(lp, old, adv, mask, LossSpec.of(AlgorithmConfig(entropy_bonus={"coef": 0.1})), norm)
    with pytest.raises(ValueError, match="entropy_coef"):
        policy_loss(lp, old, adv, mask, LossSpec.of(AlgorithmConfig()), norm, entropy_coef=float("nan"))
