"""Each telemetry metric against a naive reference written here (plain Python loops), on random inputs
of several shapes, with masks, fully masked rows and empty batches; and class accumulation over several
updates against one update on the union."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from stare_lightning.algorithms import clipped_surrogate, zero_variance_groups
from stare_lightning.metrics import (
    DEFAULT_REFLECTION_WORDS,
    AvgAtN,
    ClipFraction,
    DistinctCorrect,
    EntropyForecast,
    FracZeroStdGroups,
    GateRate,
    GradNorm,
    PassAtK,
    QuadrantMass,
    ReflectionWords,
    ResponseLength,
    RewardStats,
    RolloutCounters,
    SelectedFraction,
    TokenEntropy,
    TruncatedFraction,
    UpdateLoss,
)

SHAPES = [(1, 1), (3, 7), (5, 12), (0, 4), (4, 0)]
QUADS = ("pos_high", "pos_low", "neg_high", "neg_low")


def clip_counts(ratio, adv, mask, eps_low, eps_high):
    """The clip counts the loss reports (through the one clip definition, ``clipped_surrogate``)."""
    _, stats = clipped_surrogate(ratio.log(), torch.zeros_like(ratio), adv, mask, eps_low=eps_low, eps_high=eps_high)
    return stats.clip_low, stats.clip_high, stats.tokens


def assert_values_close(got: dict, want: dict, tol: float = 1e-9) -> None:
    assert set(got) == set(want), set(got) ^ set(want)
    for key, value in want.items():
        g = float(got[key])
        if value is None or (isinstance(value, float) and math.isnan(value)):
            assert math.isnan(g), f"{key}: got {g}, want NaN"
        else:
            assert g == pytest.approx(value, abs=tol, rel=tol), f"{key}: got {g}, want {value}"


def random_mask(gen: torch.Generator, b: int, t: int) -> torch.Tensor:
    mask = torch.rand(b, t, generator=gen) > 0.3
    if b > 1:
        mask[1] = False  # a fully masked row
    return mask


def poison(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Put NaN and inf where the mask is off: those positions must never leak into a metric."""
    x = x.clone().to(torch.float32)
    junk = torch.tensor([float("nan"), float("inf")])[torch.arange(x.numel()) % 2].reshape(x.shape)
    return torch.where(mask, x, junk)


# ------------------------------------------------------------------------------------------ references


def ref_entropy(entropy, mask):
    s, n = 0.0, 0
    for b in range(mask.shape[0]):
        for t in range(mask.shape[1]):
            if mask[b, t]:
                s += float(entropy[b, t])
                n += 1
    return {"entropy": s / n if n else float("nan")}


def ref_quadrants(adv, mask, phi, omega, selected):
    out = {}
    n_valid = int(sum(bool(m) for m in mask.flatten()))
    for definition in ("proxy", "exact"):
        tok = dict.fromkeys(QUADS, 0)
        wt = dict.fromkeys(QUADS, 0.0)
        dh = dict.fromkeys(QUADS, 0.0)
        for b in range(mask.shape[0]):
            for t in range(mask.shape[1]):
                a = float(adv[b]) if adv.dim() == 1 else float(adv[b, t])
                if not mask[b, t] or a == 0:
                    continue
                w = 1.0 if omega is None else float(omega[b, t])
                p = float(phi[b, t])
                if definition == "proxy":
                    high = selected is not None and bool(selected[b, t])
                else:
                    high = p > 0
                q = ("pos" if a > 0 else "neg") + ("_high" if high else "_low")
                tok[q] += 1
                wt[q] += w * abs(a)
                dh[q] += w * a * p
        tok_total, wt_total = sum(tok.values()), sum(wt.values())
        for q in QUADS:
            key = f"quadrant/{definition}/{q}"
            out[f"{key}/tokens"] = tok[q] / tok_total if tok_total else float("nan")
            out[f"{key}/weight"] = wt[q] / wt_total if wt_total else float("nan")
            out[f"{key}/dH"] = dh[q] / n_valid if n_valid else float("nan")
    return out


def ref_forecast(entropies, predictions, window):
    pairs = [(predictions[k - 1], entropies[k] - entropies[k - 1]) for k in range(1, len(entropies))]
    if not pairs:
        return {
            "entropy/predicted_delta": float("nan"),
            "entropy/realized_delta": float("nan"),
            "entropy/forecast_corr": float("nan"),
        }
    recent = [(p, r) for p, r in pairs[-window:] if math.isfinite(p) and math.isfinite(r)]
    corr = float("nan")
    if len(recent) >= 2:
        x = np.array([p for p, _ in recent])
        y = np.array([r for _, r in recent])
        if x.std() > 0 and y.std() > 0:
            corr = float(np.corrcoef(x, y)[0, 1])
    return {
        "entropy/predicted_delta": pairs[-1][0],
        "entropy/realized_delta": pairs[-1][1],
        "entropy/forecast_corr": corr,
    }


def _is_word_char(c: str) -> bool:
    return c.isalnum() or c == "_" or c == "-"


def ref_reflection_counts(text: str, words) -> list[int]:
    """Scan left to right; at a word start try the entries longest first; a match consumes its text."""
    low = text.lower()
    entries = [(i, [p.lower() for p in w.split()]) for i, w in enumerate(words)]
    entries.sort(key=lambda e: -len(" ".join(e[1])))
    counts = [0] * len(words)
    pos = 0
    while pos < len(low):
        if pos > 0 and _is_word_char(low[pos - 1]):
            pos += 1
            continue
        matched_end = None
        for index, parts in entries:
            j, ok = pos, True
            for n, part in enumerate(parts):
                if n > 0:
                    if j >= len(low) or not low[j].isspace():
                        ok = False
                        break
                    while j < len(low) and low[j].isspace():
                        j += 1
                if low[j : j + len(part)] != part:
                    ok = False
                    break
                j += len(part)
            if ok and (j == len(low) or not _is_word_char(low[j])):
                counts[index] += 1
                matched_end = j
                break
        pos = matched_end if matched_end is not None else pos + 1
    return counts


def ref_reflection(texts, words):
    totals = [0] * len(words)
    for text in texts:
        for i, c in enumerate(ref_reflection_counts(text, words)):
            totals[i] += c
    n = len(texts)
    out = {"reflection/per_response": sum(totals) / n if n else float("nan")}
    for w, c in zip(words, totals):
        out["reflection/" + "_".join(w.lower().split())] = c / n if n else float("nan")
    return out


def ref_pass_at_k(n_list, c_list, k):
    vals = [1.0 - math.comb(n - c, k) / math.comb(n, k) for n, c in zip(n_list, c_list)]
    return sum(vals) / len(vals) if vals else float("nan")


# --------------------------------------------------------------------------------------------- entropy


@pytest.mark.parametrize("shape", SHAPES)
def test_token_entropy_matches_reference(shape):
    gen = torch.Generator().manual_seed(hash(shape) % 1000)
    mask = random_mask(gen, *shape)
    entropy = torch.rand(shape, generator=gen) * 3
    metric = TokenEntropy()
    metric.update(poison(entropy, mask), mask)
    assert_values_close(metric.compute(), ref_entropy(entropy, mask))


def test_token_entropy_is_token_weighted_not_mean_of_means():
    entropy = torch.tensor([[1.0, 1.0, 1.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[True, True, True], [True, False, False]])
    metric = TokenEntropy()
    metric.update(entropy, mask)
    assert float(metric.compute()["entropy"]) == pytest.approx(7.0 / 4.0)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("per_sequence_adv", [False, True])
@pytest.mark.parametrize("with_optional", [False, True])
def test_quadrant_mass_matches_reference(shape, per_sequence_adv, with_optional):
    gen = torch.Generator().manual_seed(7 + shape[0] * 13 + shape[1])
    b, t = shape
    mask = random_mask(gen, b, t)
    adv = torch.randn(b if per_sequence_adv else (b, t), generator=gen)
    adv[adv.abs() < 0.3] = 0.0  # plenty of exact zeros
    phi = torch.randn(b, t, generator=gen)
    omega = (torch.rand(b, t, generator=gen) + 0.5) if with_optional else None
    selected = (torch.rand(b, t, generator=gen) > 0.6) if with_optional else None
    metric = QuadrantMass()
    metric.update(
        adv if per_sequence_adv else poison(adv, mask),
        mask,
        poison(phi, mask),
        None if omega is None else poison(omega, mask),
        selected,
    )
    got = metric.compute()
    assert len(got) == 24
    assert_values_close(got, ref_quadrants(adv, mask, phi, omega, selected))


def test_quadrant_dh_sums_to_token_mean_of_omega_a_phi():
    gen = torch.Generator().manual_seed(3)
    mask = random_mask(gen, 6, 9)
    adv, phi, omega = torch.randn(6, 9, generator=gen), torch.randn(6, 9, generator=gen), torch.rand(6, 9) + 0.5
    metric = QuadrantMass()
    metric.update(adv, mask, phi, omega, torch.rand(6, 9, generator=gen) > 0.5)
    out = metric.compute()
    want = float((omega.double() * adv.double() * phi.double())[mask].sum() / mask.sum())
    for definition in ("proxy", "exact"):
        assert sum(float(out[f"quadrant/{definition}/{q}/dH"]) for q in QUADS) == pytest.approx(want, abs=1e-9)
        assert sum(float(out[f"quadrant/{definition}/{q}/tokens"]) for q in QUADS) == pytest.approx(1.0)
        assert sum(float(out[f"quadrant/{definition}/{q}/weight"]) for q in QUADS) == pytest.approx(1.0)


def test_quadrant_all_zero_advantage_gives_nan_shares_and_zero_dh():
    metric = QuadrantMass()
    metric.update(torch.zeros(2), torch.ones(2, 3, dtype=torch.bool), torch.randn(2, 3))
    out = metric.compute()
    assert math.isnan(float(out["quadrant/exact/pos_high/tokens"]))
    assert float(out["quadrant/exact/pos_high/dH"]) == 0.0


@pytest.mark.parametrize("window", [2, 3, 8])
def test_entropy_forecast_matches_reference(window):
    rng = random.Random(window)
    metric = EntropyForecast(window=window)
    entropies, predictions = [], []
    for step in range(12):
        h = rng.uniform(0.0, 1.0)
        p = float("nan") if step == 4 else rng.uniform(-0.1, 0.1)
        entropies.append(h)
        predictions.append(p)
        got = metric(torch.tensor(h, dtype=torch.float64) if step % 2 else h, p)
        assert_values_close(got, ref_forecast(entropies, predictions, window), tol=1e-9)


def test_entropy_forecast_window_survives_state_dict():
    a = EntropyForecast(window=5)
    for h, p in [(0.5, 0.01), (0.4, -0.02), (0.45, 0.03), (0.3, -0.05)]:
        a.update(h, p)
    b = EntropyForecast(window=5)
    b.load_state_dict(a.state_dict())
    b.update(0.35, 0.0)
    a.update(0.35, 0.0)
    assert_values_close(b.compute(), {k: float(v) for k, v in a.compute().items()})


# ------------------------------------------------------------------------------------------ reflection


TRICKY_PIECES = [
    "wait",
    "Wait",
    "WAIT,",
    "waiting",
    "await",
    "re-check",
    "recheck",
    "Recheck!",
    "prechecked",
    "rechecked",
    "double-check",
    "double-checked",
    "check",
    "let",
    "me",
    "Let me",
    "verify",
    "verify.",
    "re-evaluate",
    "hmm",
    "hmmm",
    "However",
    "mistake",
    "mistakes",
    "actually",
    "x-wait",
    "let me\nverify",
    "let  me check",
    "let me re-examine",
    "re-examine",
    "rethink",
    "reconsider",
    "alternatively",
    "2wait",
    "_wait",
    "wait_",
]


def random_texts(rng: random.Random, n: int) -> list[str]:
    texts = []
    for _ in range(n):
        pieces = [rng.choice(TRICKY_PIECES) for _ in range(rng.randint(0, 12))]
        text = ""
        for piece in pieces:
            text += rng.choice([" ", " ", "\n", ", ", "", "-", ". "]) + piece
        texts.append(text)
    return texts


@pytest.mark.parametrize("seed", range(6))
def test_reflection_words_match_reference(seed):
    rng = random.Random(seed)
    texts = random_texts(rng, rng.randint(0, 9))
    metric = ReflectionWords()
    metric.update(texts)
    assert_values_close(metric.compute(), ref_reflection(texts, DEFAULT_REFLECTION_WORDS))


@pytest.mark.parametrize("seed", range(4))
def test_reflection_overlapping_custom_words_match_reference(seed):
    """Entries that are prefixes of one another: the longest wins at each position, nothing is counted twice."""
    words = ["let me", "let me check", "check", "re", "re-check", "wait", "wait wait", "Me"]
    rng = random.Random(100 + seed)
    texts = random_texts(rng, 8)
    metric = ReflectionWords(words=words)
    metric.update(texts)
    assert_values_close(metric.compute(), ref_reflection(texts, words))
    metric = ReflectionWords(words=words)
    metric.update(["Let me check: wait  wait, wait. re re-check me"])
    out = metric.compute()
    assert [float(out["reflection/" + "_".join(w.lower().split())]) for w in words] == [0, 1, 0, 1, 1, 1, 1, 1]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Let me re-check that. RECHECK.", {"re-check": 1, "recheck": 1}),
        ("prechecked rechecked pre-check", {}),
        ("double-check and check", {"double-check": 1}),
        ("let me verify; verify", {"let me verify": 1, "verify": 1}),
        ("Let me\n  check", {"let me check": 1}),
        ("wait-wait hmm, Wait!", {"hmm": 1, "wait": 1}),
        ("a mistake, mistakes", {"mistake": 1}),
    ],
)
def test_reflection_word_boundaries(text, expected):
    metric = ReflectionWords()
    metric.update([text])
    out = metric.compute()
    for word in DEFAULT_REFLECTION_WORDS:
        key = "reflection/" + "_".join(word.split())
        assert float(out[key]) == expected.get(word, 0), (word, text)
    assert float(out["reflection/per_response"]) == sum(expected.values())


def test_reflection_custom_words_and_validation():
    metric = ReflectionWords(words=["check", "Oh no"])
    metric.update(["re-check check, oh   NO", ""])
    out = metric.compute()
    assert set(out) == {"reflection/per_response", "reflection/check", "reflection/oh_no"}
    assert float(out["reflection/check"]) == 0.5
    assert float(out["reflection/oh_no"]) == 0.5
    with pytest.raises(ValueError):
        ReflectionWords(words=["wait", "WAIT"])
    with pytest.raises(ValueError):
        ReflectionWords(words=[])
    with pytest.raises(TypeError):
        metric.update("one string")


# -------------------------------------------------------------------------------------------- accuracy


@pytest.mark.parametrize("seed", range(4))
def test_pass_at_k_and_avg_at_n_match_reference(seed):
    rng = random.Random(seed)
    prompts = rng.randint(1, 12)
    n_list = [rng.randint(8, 40) for _ in range(prompts)]
    c_list = [rng.randint(0, n) for n in n_list]
    ks = (1, 2, 5, 8)
    metric = PassAtK(k=ks)
    metric.update(torch.tensor(c_list), torch.tensor(n_list))
    assert_values_close(metric.compute(), {f"pass@{k}": ref_pass_at_k(n_list, c_list, k) for k in ks}, tol=1e-12)
    avg = AvgAtN()
    avg.update(torch.tensor(c_list), torch.tensor(n_list))
    assert_values_close(avg.compute(), {"avg@n": sum(c / n for c, n in zip(c_list, n_list)) / prompts})


def test_pass_at_k_large_n_is_stable_and_validates():
    metric = PassAtK(k=(1, 64))
    metric.update(torch.tensor([1, 0, 500]), 1024)
    out = metric.compute()
    want_64 = (
        1.0 - math.comb(1023, 64) / math.comb(1024, 64) + 0.0 + 1.0 - math.comb(524, 64) / math.comb(1024, 64)
    ) / 3
    assert float(out["pass@64"]) == pytest.approx(want_64, rel=1e-12)
    assert float(out["pass@1"]) == pytest.approx((1 / 1024 + 0 + 500 / 1024) / 3, rel=1e-12)
    with pytest.raises(ValueError):
        PassAtK(k=8).update(torch.tensor([1, 2]), torch.tensor([8, 4]))
    with pytest.raises(ValueError):
        PassAtK(k=1).update(torch.tensor([5]), 4)
    with pytest.raises(ValueError):
        PassAtK(k=0)


@pytest.mark.parametrize("seed", range(4))
def test_distinct_correct_matches_reference(seed):
    rng = random.Random(seed)
    groups, flags = [], []
    for _ in range(rng.randint(0, 6)):
        g = rng.randint(1, 6)
        groups.append([rng.choice(["42", " 42", "42\n", "x = 1", "x=1", "  x = 1 "]) for _ in range(g)])
        flags.append([rng.random() < 0.6 for _ in range(g)])
    metric = DistinctCorrect()
    metric.update(groups, flags)
    distinct = [len({t.strip() for t, ok in zip(ts, fs) if ok}) for ts, fs in zip(groups, flags)]
    want = sum(distinct) / len(distinct) if distinct else float("nan")
    assert_values_close(metric.compute(), {"distinct_correct": want})


def test_distinct_correct_tensor_flags():
    metric = DistinctCorrect()
    metric.update([["a", "a ", "b"], ["c", "d", "c"]], torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool))
    assert float(metric.compute()["distinct_correct"]) == pytest.approx((1 + 2) / 2)


# --------------------------------------------------------------------------------------------- rollout


@pytest.mark.parametrize("n", [0, 1, 9])
def test_response_length_matches_reference(n):
    lengths = torch.randint(0, 50, (n,))
    metric = ResponseLength()
    metric.update(lengths)
    values = lengths.tolist()
    want = {
        "response_length/mean": sum(values) / n if n else float("nan"),
        "response_length/max": max(values) if n else float("nan"),
    }
    assert_values_close(metric.compute(), want)


def test_response_length_from_mask():
    metric = ResponseLength()
    metric.update(torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool))
    assert_values_close(metric.compute(), {"response_length/mean": 2.5, "response_length/max": 3.0})


@pytest.mark.parametrize("shape", SHAPES)
def test_clip_fraction_matches_reference(shape):
    gen = torch.Generator().manual_seed(shape[0] * 31 + shape[1])
    mask = random_mask(gen, *shape)
    ratio = torch.rand(shape, generator=gen) * 1.2 + 0.4
    adv = torch.randn(shape, generator=gen)
    metric = ClipFraction()
    metric.update(*clip_counts(ratio, adv, mask, 0.2, 0.28))
    low = high = n = 0
    for b in range(shape[0]):
        for t in range(shape[1]):
            if not mask[b, t]:
                continue
            n += 1
            r, a = float(ratio[b, t]), float(adv[b, t])
            low += a < 0 and r < 1 - 0.2
            high += a > 0 and r > 1 + 0.28
    # No valid token reads 0 (the clip bound nothing), as the training logs always had it.
    want = {"clip_ratio/low": low / max(n, 1), "clip_ratio/high": high / max(n, 1)}
    assert_values_close(metric.compute(), want)


def test_gate_rate():
    flags = [True, False, False, True, True]
    metric = GateRate()
    for f in flags:
        metric.update(f)
    metric.update(torch.tensor([False, True]))
    assert float(metric.compute()["stare/gate_on"]) == pytest.approx(4 / 7)


@pytest.mark.parametrize("seed", range(4))
def test_frac_zero_std_groups_matches_reference(seed):
    gen = torch.Generator().manual_seed(seed)
    p, g = 7, 4
    rewards = torch.randint(0, 2, (p, g), generator=gen).float()
    rewards[1] = 0.5  # a group that agrees on a non-binary reward
    metric = FracZeroStdGroups()
    metric.update(zero_variance_groups(rewards[:3]))  # the flags dynamic sampling filters on, in two updates
    metric.update(zero_variance_groups(rewards[3:]))
    zero = sum(len({float(v) for v in rewards[i]}) == 1 for i in range(p))
    assert_values_close(metric.compute(), {"frac_zero_std_groups": zero / p})


# --------------------------------------------------------------------------- accumulation over updates


def test_accumulating_chunks_equals_one_update_on_the_union():
    gen = torch.Generator().manual_seed(11)
    b, t = 9, 6
    mask = random_mask(gen, b, t)
    entropy, adv, phi = torch.rand(b, t, generator=gen), torch.randn(b, generator=gen), torch.randn(b, t, generator=gen)
    omega, sel = torch.rand(b, t, generator=gen) + 0.5, torch.rand(b, t, generator=gen) > 0.5
    ratio = torch.rand(b, t, generator=gen) + 0.5
    cuts = [(0, 2), (2, 2), (2, 7), (7, 9)]  # includes an empty chunk

    def feed(metrics, lo, hi):
        metrics["entropy"].update(entropy[lo:hi], mask[lo:hi])
        metrics["quadrant"].update(adv[lo:hi], mask[lo:hi], phi[lo:hi], omega[lo:hi], sel[lo:hi])
        metrics["clip"].update(*clip_counts(ratio[lo:hi], adv[lo:hi], mask[lo:hi], 0.2, 0.2))
        metrics["length"].update(mask[lo:hi])

    def make():
        return {
            "entropy": TokenEntropy(),
            "quadrant": QuadrantMass(),
            "clip": ClipFraction(),
            "length": ResponseLength(),
        }

    union, chunked = make(), make()
    feed(union, 0, b)
    for lo, hi in cuts:
        feed(chunked, lo, hi)
    for name in union:
        want = {k: float(v) for k, v in union[name].compute().items()}
        assert_values_close(chunked[name].compute(), want, tol=1e-12)


def test_forward_returns_batch_value_and_keeps_accumulating():
    metric = TokenEntropy()
    batch = metric(torch.tensor([[1.0, 3.0]]), torch.tensor([[True, True]]))
    assert float(batch["entropy"]) == 2.0
    metric(torch.tensor([[5.0, 0.0]]), torch.tensor([[True, False]]))
    assert float(metric.compute()["entropy"]) == pytest.approx(3.0)


# ------------------------------------------------------------------------------ step bookkeeping


def test_step_bookkeeping_matches_naive_sums():
    gen = torch.Generator().manual_seed(3)
    rewards = [torch.randint(0, 3, (4, 8), generator=gen).float() / 2, torch.rand(2, 8, generator=gen)]
    metric = RewardStats()
    for r in rewards:
        metric.update(r)
    flat = [float(v) for r in rewards for v in r.flatten()]
    mean = sum(flat) / len(flat)
    std = (sum((v - mean) ** 2 for v in flat) / len(flat)) ** 0.5  # population std
    assert_values_close(metric.compute(), {"reward/mean": mean, "reward/std": std}, tol=1e-12)

    mask = random_mask(gen, 5, 7)
    adv, selected = torch.randn(5, generator=gen), torch.rand(5, 7, generator=gen) > 0.6
    adv[2] = 0.0
    selection = SelectedFraction()
    selection.update(selected, adv, mask)
    pos = [(b, t) for b in range(5) for t in range(7) if mask[b, t] and adv[b] > 0]
    neg = [(b, t) for b in range(5) for t in range(7) if mask[b, t] and adv[b] < 0]
    want = {
        "stare/selected_frac/pos": sum(bool(selected[i]) for i in pos) / len(pos) if pos else 0.0,
        "stare/selected_frac/neg": sum(bool(selected[i]) for i in neg) / len(neg) if neg else 0.0,
    }
    assert_values_close(selection.compute(), want)

    truncated = TruncatedFraction()
    truncated.update(torch.tensor([True, False, False, True]))
    assert_values_close(truncated.compute(), {"response_length/truncated_frac": 0.5})

    loss = UpdateLoss()
    shares = [(0.5, 0.25, 2.0, 10), (-1.5, -1.0, 1.0, 6), (0.75, 0.5, 0.0, 4)]
    for share in shares:
        loss.update(*share)
    loss.update(steps=1)
    loss.update(steps=1)
    total = [sum(s[i] for s in shares) for i in range(4)]
    want = {"loss": total[0] / 2, "pg_loss": total[1] / 2, "kl": total[2] / total[3]}
    assert_values_close(loss.compute(), want)

    norm = GradNorm()
    assert math.isnan(float(norm.compute()["grad_norm"]))  # no step taken
    norm.update(1.0)
    norm.update(3.0)
    assert_values_close(norm.compute(), {"grad_norm": 2.0})

    counters = RolloutCounters()
    counters.update(tokens=120, seconds=2.0, timeouts=1, errors=0, batches=1)
    counters.update(tokens=30, seconds=1.0, timeouts=0, errors=2, batches=1)
    want = {"rollout/tokens_per_s": 50.0, "generation_batches": 2.0, "verifier/timeouts": 1.0, "verifier/errors": 2.0}
    assert_values_close(counters.compute(), want)


def test_same_batch_change_splits_the_first_order_change_by_exact_quadrant():
    from stare_lightning.metrics import SameBatchEntropyChange

    torch.manual_seed(3)
    realised, first = torch.randn(4, 6), torch.randn(4, 6)
    phi = torch.randn(4, 6)
    advantages = torch.tensor([1.0, -0.5, 0.0, 2.0])
    mask = torch.ones(4, 6, dtype=torch.bool)
    mask[1, 4:] = False
    metric = SameBatchEntropyChange()
    metric.update(realised[:2], first[:2], advantages[:2], mask[:2], phi[:2])  # two micro-batches
    metric.update(realised[2:], first[2:], advantages[2:], mask[2:], phi[2:])
    out = metric.compute()
    n = mask.sum()
    assert torch.isclose(out["entropy/realized_delta_same_batch"], (realised[mask].double().sum() / n))
    assert torch.isclose(out["entropy/first_order_delta"], (first[mask].double().sum() / n))
    adv = advantages[:, None].expand(4, 6)
    expected = {
        "pos_high": (adv > 0) & (phi > 0),
        "pos_low": (adv > 0) & (phi <= 0),
        "neg_high": (adv < 0) & (phi > 0),
        "neg_low": (adv < 0) & (phi <= 0),
    }
    for quadrant, cell in expected.items():
        value = first[cell & mask].double().sum() / n
        assert torch.isclose(out[f"quadrant/first_order/{quadrant}"], value), quadrant
    nonzero = mask & (adv != 0)  # the row with A = 0 is in no quadrant
    assert torch.isclose(sum(out[f"quadrant/first_order/{q}"] for q in expected), first[nonzero].double().sum() / n)
