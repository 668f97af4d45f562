"""STARE weights, scopes and controller against slow loop implementations."""

import json
import math
import warnings
from fractions import Fraction

import pytest
import torch

from stare_lightning.algorithms import (
    STAREConfig,
    STAREController,
    STARERule,
    StepParams,
    clipped_surrogate,
    stare_token_weights,
    stare_weights_for_scope,
)
from stare_lightning.distributed import gather_variable_length


def one_part_weights(lp, adv, mask, *, scope="step", sensitivity=None, entropy=None, generator=None, **settings):
    """``stare_weights_for_scope`` on a single [B, T] part with the rule's fields as keywords: (weights, stats)."""
    (weights,), (stats,) = stare_weights_for_scope(
        [lp],
        [adv],
        [mask],
        rule=STARERule.of(**settings),
        scope=scope,
        sensitivity=None if sensitivity is None else [sensitivity],
        entropy=None if entropy is None else [entropy],
        generator=generator,
    )
    return weights, stats


# ---------------------------------------------------------------- slow references


def k_of(P, n):
    if P == 0 or n == 0:
        return 0
    return min(n, max(1, math.ceil(Fraction(str(P)) * n)))


def loop_select(tokens, P):
    """tokens: list of (score, advantage) in stream order. Returns (set L+, set L-) of stream indices."""
    chosen = []
    for sign in (1, -1):
        members = [i for i, (_, a) in enumerate(tokens) if sign * a > 0]
        members.sort(key=lambda i: (-tokens[i][0], i))
        chosen.append(set(members[: k_of(P, len(members))]))
    return chosen[0], chosen[1]


def loop_weights_segments(parts, segment_of, P, variant, w, m, gate_on, use_sensitivity=False):
    """parts: list of (logprobs, adv, mask, sensitivity) [B_i, T_i]; segment_of(part, global_row) -> key."""
    streams = {}
    row0 = 0
    for pi, (lp, adv, mask, sens) in enumerate(parts):
        for b in range(lp.shape[0]):
            for t in range(lp.shape[1]):
                if not mask[b, t]:
                    continue
                a = float(adv[b]) if adv.dim() == 1 else float(adv[b, t])
                score = float(sens[b, t]) if use_sensitivity else -float(lp[b, t])
                streams.setdefault(segment_of(pi, row0 + b), []).append(((score, a), (pi, b, t)))
        row0 += lp.shape[0]
    weights = [torch.ones(lp.shape) for lp, *_ in parts]
    selected = [torch.zeros(lp.shape, dtype=torch.bool) for lp, *_ in parts]
    for items in streams.values():
        pos, neg = loop_select([x for x, _ in items], P)
        for i, (_, (pi, b, t)) in enumerate(items):
            if i in pos or i in neg:
                selected[pi][b, t] = True
            if gate_on and i in pos:
                weights[pi][b, t] = w
            if gate_on and variant == "C2" and i in neg:
                weights[pi][b, t] = m
    return weights, selected


def random_batch(seed, B=6, T=10, adv_1d=True, ties=True):
    g = torch.Generator().manual_seed(seed)
    if ties:
        lp = -torch.randint(0, 4, (B, T), generator=g).float() * 0.5  # many equal surprisals
    else:
        lp = -torch.rand(B, T, generator=g) * 5
    mask = torch.rand(B, T, generator=g) > 0.3
    mask[1] = False  # an empty row
    if adv_1d:
        adv = torch.randint(-1, 2, (B,), generator=g).float() * torch.rand(B, generator=g)
        adv[0], adv[2] = 0.7, -0.4
    else:
        adv = torch.randn(B, T, generator=g)
        adv[:, 0] = 0.0
    sens = torch.randint(-3, 4, (B, T), generator=g).float() * 0.25
    return lp, adv, mask, sens


# ---------------------------------------------------------------- stare_token_weights


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("P", [0.0, 0.1, 0.25, 1.0])
@pytest.mark.parametrize("variant", ["O1", "C2"])
@pytest.mark.parametrize("adv_1d", [True, False])
def test_weights_match_loop(seed, P, variant, adv_1d):
    lp, adv, mask, sens = random_batch(seed, adv_1d=adv_1d)
    weights, st = stare_token_weights(lp, adv, mask, variant=variant, top_ratio=P, w=1.3, m=0.7)
    want, sel = loop_weights_segments([(lp, adv, mask, sens)], lambda p, r: 0, P, variant, 1.3, 0.7, True)
    assert torch.equal(weights, want[0])
    assert torch.equal(st.selected, sel[0])
    a = adv.unsqueeze(1).expand_as(lp) if adv_1d else adv
    assert st.num_pos.item() == int((mask & (a > 0)).sum())
    assert st.num_neg.item() == int((mask & (a < 0)).sum())
    assert st.selected_pos.item() == k_of(P, int(st.num_pos.item()))
    assert st.selected_neg.item() == k_of(P, int(st.num_neg.item()))
    assert st.num_valid.item() == int(mask.sum())
    assert weights.dtype == torch.float32 and not weights.requires_grad
    assert (weights[~mask] == 1).all()


def test_sensitivity_selector_matches_loop():
    lp, adv, mask, sens = random_batch(4)
    weights, _ = stare_token_weights(
        lp, adv, mask, variant="C2", top_ratio=0.3, selector="sensitivity", sensitivity=sens
    )
    want, _ = loop_weights_segments(
        [(lp, adv, mask, sens)], lambda p, r: 0, 0.3, "C2", 1.1, 0.9, True, use_sensitivity=True
    )
    assert torch.equal(weights, want[0])


def test_gate_off_all_ones_but_selection_reported():
    lp, adv, mask, _ = random_batch(5)
    weights, st = stare_token_weights(lp, adv, mask, variant="C2", gate_on=False)
    assert torch.equal(weights, torch.ones_like(weights))
    assert st.selected_pos.item() > 0 and not st.gate_on


def test_zero_advantages_and_empty_mask_select_nothing():
    lp, _, mask, _ = random_batch(6)
    w0, st = stare_token_weights(lp, torch.zeros(lp.shape[0]), mask, top_ratio=1.0)
    assert torch.equal(w0, torch.ones_like(w0)) and st.selected_pos.item() == 0 and st.selected_neg.item() == 0
    w1, st = stare_token_weights(lp, torch.ones(lp.shape[0]), torch.zeros_like(mask), top_ratio=1.0)
    assert torch.equal(w1, torch.ones_like(w1)) and st.num_valid.item() == 0


def test_k_rounding_and_ties_by_position():
    # 100 positive tokens, P = 0.07: exactly 7 (0.07 * 100 is 7.000000000000001 in floating point)
    lp = torch.full((1, 100), -1.0)
    ones = torch.ones(1, 100, dtype=torch.bool)
    w, st = stare_token_weights(lp, torch.ones(1), ones, top_ratio=0.07, w=2.0)
    assert st.selected_pos.item() == 7
    assert torch.equal(w[0, :7], torch.full((7,), 2.0)) and (w[0, 7:] == 1).all()  # ties: earliest win
    # P tiny but > 0 still selects one
    _, st = stare_token_weights(lp, torch.ones(1), ones, top_ratio=1e-10)
    assert st.selected_pos.item() == 1


def test_weights_never_flip_gradient_sign():
    lp, adv, mask, _ = random_batch(7, adv_1d=False, ties=False)
    weights, _ = stare_token_weights(lp, adv, mask, variant="C2", top_ratio=0.5, w=1.5, m=0.5)
    old = lp + 0.2 * torch.randn(lp.shape, generator=torch.Generator().manual_seed(1))
    grads = []
    for wts in (None, weights):
        x = lp.clone().requires_grad_()
        loss, _ = clipped_surrogate(x, old, adv, mask, eps_low=0.2, eps_high=0.28, dual_clip_c=3.0, token_weights=wts)
        loss.sum().backward()
        grads.append(x.grad)
    assert torch.equal(torch.sign(grads[0]), torch.sign(grads[1]))
    assert torch.count_nonzero(grads[1] != grads[0]) > 0


def test_sensitivity_selector_needs_phi():
    lp, adv, mask, _ = random_batch(0)
    with pytest.raises(ValueError, match="sensitivity"):
        stare_token_weights(lp, adv, mask, selector="sensitivity")


# Ranges are checked once, where a run's settings enter: STAREConfig (which builds the controller).
@pytest.mark.parametrize(
    "kwargs, key",
    [
        ({"variant": "O2"}, "variant"),
        ({"top_ratio": -0.1}, "top_ratio"),
        ({"top_ratio": 1.5}, "top_ratio"),
        ({"w": 0.0}, "w"),
        ({"w": float("inf")}, "w"),
        ({"m": -1.0}, "m"),
        ({"selector": "likelihood"}, "selector"),
        ({"target_entropy": -0.1}, "target_entropy"),
        ({"alpha": -0.01}, "alpha"),
        ({"w_max": 0.9}, "w_max"),
        ({"m_min": 0.0}, "m_min"),
        ({"m_min": 1.2}, "m_min"),
        ({"timing": "later"}, "timing"),
        ({"adaptive": True, "w": 2.0}, "w"),
        ({"adaptive": True, "m": 0.2}, "m"),
    ],
)
def test_stare_settings_are_range_checked_by_the_config(kwargs, key):
    with pytest.raises(ValueError, match=f"algorithm.stare.{key}="):
        STAREConfig(**kwargs)


# ---------------------------------------------------------------- scopes


def split_with_own_padding(lp, adv, mask, sens, sizes):
    parts, row = [], 0
    for size in sizes:
        rows = slice(row, row + size)
        valid_cols = mask[rows].any(0).nonzero()
        t_i = int(valid_cols.max()) + 1 if valid_cols.numel() else 1
        t_i = min(lp.shape[1], t_i + 2)  # some extra padding too
        a = adv[rows] if adv.dim() == 1 else adv[rows, :t_i]
        parts.append((lp[rows, :t_i], a, mask[rows, :t_i], sens[rows, :t_i]))
        row += size
    return parts


@pytest.mark.parametrize("sizes", [[6], [1, 5], [2, 2, 2], [1, 1, 1, 1, 1, 1], [4, 2]])
@pytest.mark.parametrize("adv_1d", [True, False])
def test_step_scope_independent_of_micro_batch_split(sizes, adv_1d):
    lp, adv, mask, sens = random_batch(8, adv_1d=adv_1d)
    whole, _ = one_part_weights(lp, adv, mask, scope="step", variant="C2", top_ratio=0.2)
    parts = split_with_own_padding(lp, adv, mask, sens, sizes)
    rule = STARERule.of(variant="C2", top_ratio=0.2)
    got, stats = stare_weights_for_scope(
        [p[0] for p in parts], [p[1] for p in parts], [p[2] for p in parts], scope="step", rule=rule
    )
    row = 0
    for (plp, _, pmask, _), wts in zip(parts, got):
        b, t = plp.shape
        assert torch.equal(wts[pmask], whole[row : row + b, :t][pmask])
        row += b
    want, _ = loop_weights_segments([(lp, adv, mask, sens)], lambda p, r: 0, 0.2, "C2", 1.1, 0.9, True)
    assert torch.equal(whole, want[0])
    assert sum(s.selected_pos.item() for s in stats) == k_of(0.2, int(sum(s.num_pos.item() for s in stats)))


@pytest.mark.parametrize("scope", ["micro_batch", "sequence", "group"])
def test_other_scopes_match_loop(scope):
    lp, adv, mask, sens = random_batch(9, B=8, adv_1d=False)
    parts = split_with_own_padding(lp, adv, mask, sens, [3, 1, 4])
    segment = {
        "micro_batch": lambda p, r: p,
        "sequence": lambda p, r: r,
        "group": lambda p, r: r // 2,
    }[scope]
    got, _ = stare_weights_for_scope(
        [p[0] for p in parts],
        [p[1] for p in parts],
        [p[2] for p in parts],
        scope=scope,
        group_size=2,
        rule=STARERule.of(variant="C2", top_ratio=0.3, selector="sensitivity"),
        sensitivity=[p[3] for p in parts],
    )
    want, _ = loop_weights_segments(parts, segment, 0.3, "C2", 1.1, 0.9, True, use_sensitivity=True)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_micro_batch_scope_on_one_tensor_is_stare_token_weights():
    lp, adv, mask, _ = random_batch(10)
    a, _ = one_part_weights(lp, adv, mask, scope="micro_batch", top_ratio=0.4)
    b, _ = stare_token_weights(lp, adv, mask, top_ratio=0.4)
    assert torch.equal(a, b)


def test_scope_value_errors():
    lp, adv, mask, _ = random_batch(11)
    rule = STARERule()
    with pytest.raises(ValueError, match="scope"):
        stare_weights_for_scope([lp], [adv], [mask], rule=rule, scope="batch")
    with pytest.raises(ValueError, match="group_size"):
        stare_weights_for_scope([lp], [adv], [mask], rule=rule, scope="group")
    with pytest.raises(ValueError, match="group_size"):
        stare_weights_for_scope([lp], [adv], [mask], rule=rule, scope="group", group_size=4)  # 6 rows
    with pytest.raises(ValueError, match="unknown"):
        STARERule.of(topk=2)
    # One input type: a bare tensor (not a list of parts) and keyword settings (not a rule) are refused by name.
    with pytest.raises(ValueError, match=r"logprobs is one tensor: pass a list"):
        stare_weights_for_scope(lp, [adv], [mask], rule=rule)
    with pytest.raises(ValueError, match=r"sensitivity is one tensor"):
        stare_weights_for_scope([lp], [adv], [mask], rule=rule, sensitivity=lp)
    with pytest.raises(ValueError, match="pass a STARERule"):
        stare_weights_for_scope([lp], [adv], [mask], rule={"top_ratio": 0.2})
    with pytest.raises(TypeError):
        stare_weights_for_scope([lp], [adv], [mask], rule=rule, top_ratio=0.2)
    weights, stats = stare_weights_for_scope([lp], [adv], [mask], rule=rule)  # the accepted form: lists out
    assert isinstance(weights, list) and isinstance(stats, list) and len(weights) == len(stats) == 1

    # other scopes never communicate: a gather is accepted and not called
    def refuse(t):
        raise AssertionError("gather called")

    a, _ = stare_weights_for_scope([lp], [adv], [mask], rule=rule, scope="sequence", gather=refuse)
    b, _ = stare_weights_for_scope([lp], [adv], [mask], rule=rule, scope="sequence")
    assert torch.equal(a[0], b[0])


def test_gather_is_identity_without_distributed():
    t = torch.arange(5.0)
    assert gather_variable_length(t) is t
    with pytest.raises(ValueError, match="1-D"):
        gather_variable_length(torch.zeros(2, 2))


# ---------------------------------------------------------------- controller


def test_gate_is_strict_and_fixed_weights():
    c = STAREController(target_entropy=0.3, w=1.1, m=0.9)
    assert c.update(0.3) == StepParams(False, 1.1, 0.9)
    assert c.update(0.2999) == StepParams(True, 1.1, 0.9)
    assert c.update(torch.tensor(0.5)) == StepParams(False, 1.1, 0.9)
    assert c.gate_on is False and c.last_entropy == 0.5 and (c.w, c.m) == (1.1, 0.9)


def test_next_step_versus_same_step_timing():
    nxt = STAREController(target_entropy=0.3, w=1.1, m=0.9, adaptive=True, alpha=0.1, timing="next_step")
    same = STAREController(target_entropy=0.3, w=1.1, m=0.9, adaptive=True, alpha=0.1, timing="same_step")
    p = nxt.update(0.1)
    assert (p.gate_on, p.w, p.m) == (True, 1.1, 0.9)
    assert nxt.w == pytest.approx(1.2) and nxt.m == pytest.approx(0.8)
    p = nxt.update(0.1)
    assert p.w == pytest.approx(1.2) and p.m == pytest.approx(0.8)
    p = same.update(0.1)
    assert p.w == pytest.approx(1.2) and p.m == pytest.approx(0.8)
    p = same.update(0.5)  # entropy above target: back down, gate off
    assert not p.gate_on and p.w == pytest.approx(1.1) and p.m == pytest.approx(0.9)
    p = same.update(0.3)  # at the target: sign 0, unchanged
    assert p.w == pytest.approx(1.1) and not p.gate_on


def test_adaptive_clipping():
    c = STAREController(target_entropy=0.3, w=1.1, m=0.9, adaptive=True, alpha=0.07, w_max=1.5, m_min=0.5)
    for _ in range(50):
        c.update(0.0)
    assert c.w == 1.5 and c.m == 0.5
    for _ in range(50):
        p = c.update(1.0)
    assert c.w == 1.0 and c.m == 1.0 and p.w == 1.0 and p.m == 1.0


def test_non_finite_entropy_keeps_state():
    c = STAREController(adaptive=True, alpha=0.1, timing="same_step")
    first = c.update(0.1)
    before = c.state_dict()
    for bad in (float("nan"), float("inf"), torch.tensor(float("nan"))):
        with pytest.warns(RuntimeWarning, match="non-finite"):
            p = c.update(bad)
        assert p == first
        assert c.state_dict() == before


def test_state_dict_round_trip():
    a = STAREController(adaptive=True, alpha=0.05, timing="next_step")
    for h in (0.1, 0.2, 0.5, 0.1):
        a.update(h)
    state = json.loads(json.dumps(a.state_dict()))  # plain Python values
    b = STAREController(adaptive=True, alpha=0.05, timing="next_step")
    b.load_state_dict(state)
    assert b.state_dict() == a.state_dict()
    for h in (0.05, 0.6, 0.25):
        assert a.update(h) == b.update(h)
    with pytest.raises(ValueError, match="missing"):
        b.load_state_dict({"w": 1.0})


def test_controller_no_warning_on_finite():
    c = STAREController()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        c.update(0.1)


def test_step_scope_with_empty_parts():
    lp, adv, mask, _ = random_batch(12)
    rule = STARERule.of(variant="C2", top_ratio=0.3)
    assert stare_weights_for_scope([], [], [], rule=rule, scope="step") == ([], [])
    empty_mask = torch.zeros_like(mask)
    got, stats = stare_weights_for_scope(
        [lp[:2], lp[2:]], [adv[:2], adv[2:]], [empty_mask[:2], mask[2:]], scope="step", rule=rule
    )
    whole, _ = stare_token_weights(lp[2:], adv[2:], mask[2:], variant="C2", top_ratio=0.3)
    assert torch.equal(got[0], torch.ones(2, lp.shape[1])) and torch.equal(got[1], whole)
    assert stats[0].num_valid.item() == 0
