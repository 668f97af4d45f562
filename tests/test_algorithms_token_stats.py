"""Chunked per-token statistics against a per-position float64 loop and against plain autograd."""

import math

import pytest
import torch

from stare_lightning.algorithms import TokenStats, token_stats_from_hidden, token_stats_from_logits


def loop_stats(logits, targets, temperature=1.0):
    """One position at a time, float64, straight from the definitions."""
    B, T, V = logits.shape
    out = {k: torch.zeros(B, T, dtype=torch.float64) for k in ("lp", "ent", "s2", "s2l")}
    for b in range(B):
        for t in range(T):
            z = [float(v) / temperature for v in logits[b, t].double()]
            mx = max(z)
            lse = mx + math.log(sum(math.exp(v - mx) for v in z))
            logp = [v - lse for v in z]
            p = [math.exp(v) for v in logp]
            out["lp"][b, t] = logp[int(targets[b, t])]
            out["ent"][b, t] = -sum(pi * li for pi, li in zip(p, logp))
            out["s2"][b, t] = sum(pi * pi for pi in p)
            out["s2l"][b, t] = sum(pi * pi * li for pi, li in zip(p, logp))
    return out


def naive(logits, targets, temperature=1.0):
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    lp = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    return lp, ent


@pytest.mark.parametrize("shape", [(1, 1, 5), (2, 7, 13), (3, 4, 50)])
@pytest.mark.parametrize("chunk", [1, 3, 1000])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_matches_loop(shape, chunk, temperature):
    g = torch.Generator().manual_seed(hash((shape, chunk)) % 1000)
    logits = torch.randn(*shape, generator=g) * 3
    targets = torch.randint(0, shape[2], shape[:2], generator=g)
    ref = loop_stats(logits, targets, temperature)
    st = token_stats_from_logits(logits, targets, temperature=temperature, chunk_size=chunk, with_sensitivity=True)
    assert isinstance(st, TokenStats)
    assert st.logprobs.dtype == torch.float32 and st.logprobs.shape == shape[:2]
    for got, key in ((st.logprobs, "lp"), (st.entropy, "ent"), (st.sum_p2, "s2"), (st.sum_p2_logp, "s2l")):
        torch.testing.assert_close(got.double(), ref[key], rtol=1e-5, atol=2e-6)


def test_bf16_logits_use_fp32_math_and_return_bf16_grads():
    g = torch.Generator().manual_seed(1)
    logits = (torch.randn(2, 5, 40, generator=g) * 4).bfloat16().requires_grad_()
    targets = torch.randint(0, 40, (2, 5), generator=g)
    st = token_stats_from_logits(logits, targets, chunk_size=3, with_sensitivity=True)
    ref = loop_stats(logits.detach(), targets)
    assert st.logprobs.dtype == torch.float32
    torch.testing.assert_close(st.logprobs.double(), ref["lp"], rtol=1e-5, atol=2e-6)
    torch.testing.assert_close(st.entropy.double(), ref["ent"], rtol=1e-5, atol=2e-6)
    (st.logprobs.sum() + st.entropy.sum()).backward()
    assert logits.grad.dtype == torch.bfloat16
    x = logits.detach().float().requires_grad_()
    lp, ent = naive(x, targets)
    (lp.sum() + ent.sum()).backward()
    torch.testing.assert_close(logits.grad.float(), x.grad.bfloat16().float(), rtol=0, atol=1e-2)


@pytest.mark.parametrize("with_entropy", [True, False])
def test_chunked_equals_unchunked_values_and_grads(with_entropy):
    g = torch.Generator().manual_seed(2)
    B, T, V = 3, 11, 97
    base = torch.randn(B, T, V, generator=g) * 2
    targets = torch.randint(0, V, (B, T), generator=g)
    w_lp, w_ent = torch.randn(B, T, generator=g), torch.randn(B, T, generator=g)
    results = []
    for chunk in (B * T, 4, 1):
        x = base.clone().requires_grad_()
        st = token_stats_from_logits(x, targets, chunk_size=chunk, with_entropy=with_entropy, temperature=0.9)
        obj = (st.logprobs * w_lp).sum()
        if with_entropy:
            obj = obj + (st.entropy * w_ent).sum()
        else:
            assert st.entropy is None
        obj.backward()
        results.append((st.logprobs.detach(), None if st.entropy is None else st.entropy.detach(), x.grad))
    for lp, ent, grad in results[1:]:
        torch.testing.assert_close(lp, results[0][0], rtol=0, atol=1e-6)
        if with_entropy:
            torch.testing.assert_close(ent, results[0][1], rtol=0, atol=1e-6)
        torch.testing.assert_close(grad, results[0][2], rtol=0, atol=1e-6)
    # and against plain autograd through log_softmax
    x = base.clone().requires_grad_()
    lp, ent = naive(x, targets, 0.9)
    obj = (lp * w_lp).sum() + ((ent * w_ent).sum() if with_entropy else 0)
    obj.backward()
    torch.testing.assert_close(results[1][2], x.grad, rtol=1e-5, atol=1e-6)


def test_gradcheck_float64_and_non_viewable_layout():
    g = torch.Generator().manual_seed(3)
    targets = torch.randint(0, 9, (2, 4), generator=g)
    x = torch.randn(2, 5, 9, dtype=torch.float64, generator=g, requires_grad=True)

    def f(z):
        st = token_stats_from_logits(z[:, 1:], targets, chunk_size=3, temperature=1.3)
        return st.logprobs, st.entropy

    assert torch.autograd.gradcheck(f, (x,))
    assert token_stats_from_logits(x[:, 1:], targets).logprobs.dtype == torch.float64


def test_sensitivity_sums_are_detached_and_only_when_asked():
    x = torch.randn(2, 3, 7, requires_grad=True)
    t = torch.zeros(2, 3, dtype=torch.long)
    st = token_stats_from_logits(x, t)
    assert st.sum_p2 is None and st.sum_p2_logp is None
    st = token_stats_from_logits(x, t, with_sensitivity=True)
    assert not st.sum_p2.requires_grad and not st.sum_p2_logp.requires_grad
    assert st.logprobs.requires_grad and st.entropy.requires_grad


@pytest.mark.parametrize("chunk", [1, 5, 64])
def test_hidden_matches_logits_values_and_grads(chunk):
    g = torch.Generator().manual_seed(4)
    B, T, D, V = 2, 6, 8, 33
    h0 = torch.randn(B, T + 1, D, generator=g)
    w0 = torch.randn(V, D, generator=g) / 2
    targets = torch.randint(0, V, (B, T), generator=g)
    w_lp, w_ent = torch.randn(B, T, generator=g), torch.randn(B, T, generator=g)

    h, W = h0.clone().requires_grad_(), w0.clone().requires_grad_()
    st = token_stats_from_hidden(h[:, :-1], W, targets, chunk_size=chunk, temperature=0.8, with_sensitivity=True)
    ((st.logprobs * w_lp).sum() + (st.entropy * w_ent).sum()).backward()

    h2, W2 = h0.clone().requires_grad_(), w0.clone().requires_grad_()
    logits = h2[:, :-1] @ W2.t()
    ref = token_stats_from_logits(logits, targets, chunk_size=chunk, temperature=0.8, with_sensitivity=True)
    ((ref.logprobs * w_lp).sum() + (ref.entropy * w_ent).sum()).backward()
    for a, b in (
        (st.logprobs, ref.logprobs),
        (st.entropy, ref.entropy),
        (st.sum_p2, ref.sum_p2),
        (st.sum_p2_logp, ref.sum_p2_logp),
    ):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(h.grad, h2.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(W.grad, W2.grad, rtol=1e-5, atol=1e-6)


def test_hidden_gradcheck_float64():
    g = torch.Generator().manual_seed(5)
    h = torch.randn(2, 3, 4, dtype=torch.float64, generator=g, requires_grad=True)
    W = torch.randn(7, 4, dtype=torch.float64, generator=g, requires_grad=True)
    t = torch.randint(0, 7, (2, 3), generator=g)

    def f(hh, ww):
        st = token_stats_from_hidden(hh, ww, t, chunk_size=4, temperature=1.2)
        return st.logprobs, st.entropy

    assert torch.autograd.gradcheck(f, (h, W))


def test_empty_batch():
    st = token_stats_from_logits(torch.zeros(0, 5, 7, requires_grad=True), torch.zeros(0, 5, dtype=torch.long))
    assert st.logprobs.shape == (0, 5)


def test_bad_targets_and_shapes():
    with pytest.raises(ValueError, match="targets"):
        token_stats_from_logits(torch.zeros(1, 2, 3), torch.tensor([[0, 3]]))
    with pytest.raises(ValueError, match="targets"):
        token_stats_from_logits(torch.zeros(1, 2, 3), torch.tensor([[-100, 0]]))
    with pytest.raises(ValueError, match="logits"):
        token_stats_from_logits(torch.zeros(2, 3), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="lm_head_weight"):
        token_stats_from_hidden(torch.zeros(1, 2, 4), torch.zeros(5, 3), torch.zeros(1, 2, dtype=torch.long))


def test_minus_inf_logits_give_finite_stats():
    logits = torch.randn(2, 3, 8)
    logits[..., 5:] = -float("inf")  # e.g. a masked vocabulary tail
    logits[0, 0, 5] = -1e30
    targets = torch.tensor([[0, 1, 2], [3, 4, 6]])  # (1, 2) targets an impossible token
    x = logits.clone().requires_grad_()
    st = token_stats_from_logits(x, targets, chunk_size=4, with_sensitivity=True)
    ref = loop_stats(logits[..., :5], targets.clamp(max=4))
    ok = targets < 5
    torch.testing.assert_close(st.logprobs[ok].double(), ref["lp"][ok], rtol=1e-5, atol=2e-6)
    torch.testing.assert_close(st.entropy.double(), ref["ent"], rtol=1e-5, atol=2e-6)
    assert st.logprobs[1, 2].item() <= -1e4 + 1
    (st.logprobs.sum() + st.entropy.sum()).backward()
    assert torch.isfinite(x.grad).all()
