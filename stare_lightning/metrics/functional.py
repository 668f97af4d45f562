"""Telemetry of STARE runs as pure update/compute function pairs (docs/method.md, section 5).

Every metric here is a pair in the torchmetrics style: ``_<name>_update(inputs) -> states`` reduces
one batch to a few tensors, and ``_<name>_compute(states) -> dict`` turns accumulated states into the
logged values. States are sums, counts or maxima, so the states of several batches or ranks combine
exactly by adding them (or taking the max); every mean is a ratio of sums (a token mean is the sum over
tokens divided by the token count, never a mean of per-sequence means). Sums are kept in float64, counts
in int64. The thin classes in this package only call these functions.

Conventions, and where this departs from or goes beyond the paper:

- An undefined ratio (0/0: no valid token, no response, no prompt) is NaN, never a made-up 0.
- Quadrants. Tokens with A == 0 belong to no quadrant: they are left out of both the numerator and the
  denominator of the token and weight shares (STARE never selects them, and they carry no gradient).
  "High" means: proxy, the token is in the STARE selected set L+ u L-; exact, Phi > 0 (Phi == 0 is "low").
  The per-quadrant dH, sum(omega * A * Phi), is divided by the number of *all* valid tokens (A == 0
  included), so it is the quadrant's contribution to the token mean of omega * A * Phi; the four values of
  one definition add up to that token mean, the first-order entropy change per unit step size under a
  token-mean loss. The paper reports the raw sum.
- Entropy forecast: the paper only says "log predicted vs realised"; the windowed Pearson correlation
  is this project's summary of it.
- Reflection words: the paper gives no list or matching rule. Here: case-insensitive, whole words where a
  hyphen counts as part of a word (so "check" never matches inside "re-check" and "recheck" never inside
  "prechecked"), whitespace runs inside a phrase match any whitespace, and matches never overlap: at each
  position the longest listed entry wins ("let me verify" counts once, as itself, not also as "verify").
- pass@k uses the unbiased estimator 1 - C(n-c, k) / C(n, k) in the product form
  1 - prod_{i=n-c+1}^{n} (1 - k / i), which never forms a large binomial coefficient.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import torch
from torch import Tensor

QUADRANTS: tuple[str, ...] = ("pos_high", "pos_low", "neg_high", "neg_low")
QUADRANT_DEFINITIONS: tuple[str, ...] = ("proxy", "exact")

DEFAULT_REFLECTION_WORDS: tuple[str, ...] = (
    "wait",
    "however",
    "alternatively",
    "hmm",
    "actually",
    "verify",
    "recheck",
    "re-check",
    "double-check",
    "reconsider",
    "rethink",
    "re-evaluate",
    "let me check",
    "let me verify",
    "let me re-examine",
    "mistake",
)

_SUM = torch.float64
_COUNT = torch.int64


# ----------------------------------------------------------------------------------------------- helpers


def _ratio(num: Tensor, den: Tensor) -> Tensor:
    """num / den in float64, NaN where den == 0."""
    num = num.to(_SUM)
    den = den.to(_SUM)
    nan = torch.full_like(num, float("nan"))
    return torch.where(den != 0, num / torch.where(den != 0, den, torch.ones_like(den)), nan)


def _valid_mask(mask: Tensor | None, like: Tensor) -> Tensor:
    if mask is None:
        return torch.ones(like.shape, dtype=torch.bool, device=like.device)
    if mask.shape != like.shape:
        raise ValueError(f"mask has shape {tuple(mask.shape)}, expected {tuple(like.shape)}")
    return mask.bool()


def _per_token(values: Tensor, mask: Tensor, name: str) -> Tensor:
    """Broadcast per-sequence values [B] to tokens [B, T]; check per-token values [B, T]."""
    if values.dim() == 1 and mask.dim() == 2:
        if values.shape[0] != mask.shape[0]:
            raise ValueError(f"{name} has {values.shape[0]} sequences, mask has {mask.shape[0]}")
        return values.unsqueeze(-1).expand(mask.shape)
    if values.shape != mask.shape:
        raise ValueError(f"{name} has shape {tuple(values.shape)}, expected {tuple(mask.shape)} or [B]")
    return values


def _masked_sum(values: Tensor, mask: Tensor) -> Tensor:
    """Sum of values where mask is True, in float64; values outside the mask (even NaN) are ignored."""
    values = values.to(_SUM)
    return torch.where(mask, values, torch.zeros_like(values)).sum()


# ----------------------------------------------------------------------------------------- token entropy


def _token_entropy_update(entropy: Tensor, mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Per-token entropy [B, T] and validity mask [B, T] -> (sum of entropy, valid token count)."""
    valid = _valid_mask(mask, entropy)
    return _masked_sum(entropy, valid), valid.sum().to(_COUNT)


def _token_entropy_compute(entropy_sum: Tensor, token_count: Tensor) -> dict[str, Tensor]:
    return {"entropy": _ratio(entropy_sum, token_count)}


# -------------------------------------------------------------------------------------- quadrant mass


def _quadrant_update(
    advantages: Tensor,
    mask: Tensor | None,
    phi: Tensor,
    omega: Tensor | None = None,
    selected: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """One batch of tokens -> quadrant states.

    Args:
        advantages: [B, T] per token, or [B] per sequence.
        mask: [B, T] valid response tokens (all valid if None).
        phi: [B, T] entropy sensitivity Phi of each sampled token.
        omega: [B, T] STARE weights (1 everywhere if None, i.e. GRPO).
        selected: [B, T] bool, the STARE selected set L+ u L- (empty if None).

    Returns:
        tokens [2, 4] int64, weight [2, 4] float64 (sum of omega * |A|), dh [2, 4] float64
        (sum of omega * A * Phi), valid_count [] int64. Rows: proxy, exact; columns: ``QUADRANTS``.
    """
    valid = _valid_mask(mask, phi)
    adv = _per_token(advantages, valid, "advantages").to(_SUM)
    phi64 = phi.to(_SUM)
    w = torch.ones_like(phi64) if omega is None else _per_token(omega, valid, "omega").to(_SUM)
    if selected is None:
        sel = torch.zeros_like(valid)
    else:
        if selected.shape != valid.shape:
            raise ValueError(f"selected has shape {tuple(selected.shape)}, expected {tuple(valid.shape)}")
        sel = selected.bool()
    pos = valid & (adv > 0)
    neg = valid & (adv < 0)
    weight_values = w * adv.abs()
    dh_values = w * adv * phi64

    tokens = torch.zeros(2, 4, dtype=_COUNT, device=phi.device)
    weight = torch.zeros(2, 4, dtype=_SUM, device=phi.device)
    dh = torch.zeros(2, 4, dtype=_SUM, device=phi.device)
    for d, high in enumerate((sel, phi64 > 0)):
        for q, cell in enumerate((pos & high, pos & ~high, neg & high, neg & ~high)):
            tokens[d, q] = cell.sum()
            weight[d, q] = _masked_sum(weight_values, cell)
            dh[d, q] = _masked_sum(dh_values, cell)
    return tokens, weight, dh, valid.sum().to(_COUNT)


def _quadrant_compute(tokens: Tensor, weight: Tensor, dh: Tensor, valid_count: Tensor) -> dict[str, Tensor]:
    """Quadrant states -> ``quadrant/{proxy,exact}/{pos_high,...}/{tokens,weight,dH}``."""
    out: dict[str, Tensor] = {}
    for d, definition in enumerate(QUADRANT_DEFINITIONS):
        token_total = tokens[d].sum()
        weight_total = weight[d].sum()
        for q, quadrant in enumerate(QUADRANTS):
            key = f"quadrant/{definition}/{quadrant}"
            out[f"{key}/tokens"] = _ratio(tokens[d, q], token_total)
            out[f"{key}/weight"] = _ratio(weight[d, q], weight_total)
            out[f"{key}/dH"] = _ratio(dh[d, q], valid_count)
    return out


# ----------------------------------------------------------------------------------- STARE's selection


def _selected_fraction_update(selected: Tensor, advantages: Tensor, mask: Tensor) -> Tensor:
    """STARE's selected set [B, T], advantages [B] or [B, T], mask -> counts [|L+|, |T+|, |L-|, |T-|]."""
    valid = _valid_mask(mask, selected)
    adv = advantages.unsqueeze(-1).expand(valid.shape) if advantages.dim() == 1 else advantages
    pos, neg = valid & (adv > 0), valid & (adv < 0)
    chosen = selected.bool()
    return torch.stack([(pos & chosen).sum(), pos.sum(), (neg & chosen).sum(), neg.sum()]).to(_COUNT)


def _selected_fraction_compute(counts: Tensor) -> dict[str, Tensor]:
    # An empty sign set selects nothing: report 0 there, as a selected share of an empty set.
    pos = _ratio(counts[0], counts[1]).nan_to_num(0.0)
    neg = _ratio(counts[2], counts[3]).nan_to_num(0.0)
    return {"stare/selected_frac/pos": pos, "stare/selected_frac/neg": neg}


# ----------------------------------------------------------------------------------- entropy forecast


def _same_batch_change_update(
    realised: Tensor, first_order: Tensor, advantages: Tensor, mask: Tensor, phi: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Sums of the realised and first-order change over valid tokens, the first-order sum per exact quadrant
    (sign(A) x sign(Phi); ``QUADRANTS`` order, A == 0 in none) and the valid count."""
    valid = _valid_mask(mask, phi)
    adv = _per_token(advantages, valid, "advantages")
    first = first_order.to(_SUM)
    high = phi > 0
    cells = (adv > 0) & high, (adv > 0) & ~high, (adv < 0) & high, (adv < 0) & ~high
    quadrants = torch.stack([_masked_sum(first, valid & cell) for cell in cells])
    return _masked_sum(realised.to(_SUM), valid), _masked_sum(first, valid), quadrants, valid.sum()


def _same_batch_change_compute(
    realised_sum: Tensor, first_sum: Tensor, quadrant_sums: Tensor, valid_count: Tensor
) -> dict[str, Tensor]:
    out = {
        "entropy/realized_delta_same_batch": _ratio(realised_sum, valid_count),
        "entropy/first_order_delta": _ratio(first_sum, valid_count),
    }
    for index, quadrant in enumerate(QUADRANTS):
        out[f"quadrant/first_order/{quadrant}"] = _ratio(quadrant_sums[index], valid_count)
    return out


def _entropy_forecast_update(
    predicted_history: Tensor,
    realized_history: Tensor,
    last_entropy: Tensor,
    last_predicted: Tensor,
    steps: Tensor,
    entropy: Tensor | float,
    predicted_delta: Tensor | float,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Record step k's entropy H_k and the predicted change for the update made at step k.

    The pair completed by this call is (predicted change of step k-1, H_k - H_{k-1}); it is appended to
    the window histories (oldest first) unless this is the first step. No host synchronisation.
    """
    h = torch.as_tensor(entropy, dtype=_SUM, device=predicted_history.device).reshape(())
    p = torch.as_tensor(predicted_delta, dtype=_SUM, device=predicted_history.device).reshape(())
    has_previous = steps > 0
    shifted_pred = torch.cat([predicted_history[1:], last_predicted.reshape(1)])
    shifted_real = torch.cat([realized_history[1:], (h - last_entropy).reshape(1)])
    predicted_history = torch.where(has_previous, shifted_pred, predicted_history)
    realized_history = torch.where(has_previous, shifted_real, realized_history)
    return predicted_history, realized_history, h, p, steps + 1


def _pearson(x: Tensor, y: Tensor) -> Tensor:
    """Pearson correlation over the entries where both are finite; NaN with fewer than 2 or no variance."""
    ok = torch.isfinite(x) & torch.isfinite(y)
    n = ok.sum()
    zero = torch.zeros_like(x)
    x0 = torch.where(ok, x, zero)
    y0 = torch.where(ok, y, zero)
    mean_x = x0.sum() / n.clamp(min=1)
    mean_y = y0.sum() / n.clamp(min=1)
    dx = torch.where(ok, x - mean_x, zero)
    dy = torch.where(ok, y - mean_y, zero)
    corr = _ratio((dx * dy).sum(), torch.sqrt((dx * dx).sum() * (dy * dy).sum()))
    corr = corr.clamp(-1.0, 1.0)  # NaN passes through clamp
    return torch.where(n >= 2, corr, torch.full_like(corr, float("nan")))


def _entropy_forecast_compute(predicted_history: Tensor, realized_history: Tensor) -> dict[str, Tensor]:
    """Latest completed pair, and the correlation over the finite pairs of the window."""
    return {
        "entropy/predicted_delta": predicted_history[-1].clone(),
        "entropy/realized_delta": realized_history[-1].clone(),
        "entropy/forecast_corr": _pearson(predicted_history, realized_history),
    }


# ------------------------------------------------------------------------------------ reflection words


def reflection_key(word: str) -> str:
    """Metric name of one reflection word or phrase: ``reflection/<word>``, spaces as underscores."""
    return "reflection/" + "_".join(word.lower().split())


def reflection_pattern(words: Sequence[str]) -> re.Pattern[str]:
    """One compiled regex matching any entry of ``words``; group i + 1 is ``words[i]``.

    Entries are tried longest first, so at a given position the longest entry wins.
    """
    if not words:
        raise ValueError("the reflection word list is empty")
    keys = [reflection_key(w) for w in words]
    if any(not w.strip() for w in words):
        raise ValueError("a reflection word is empty")
    if len(set(keys)) != len(keys):
        raise ValueError(f"reflection words collide after lower-casing and sanitising: {list(words)}")
    order = sorted(range(len(words)), key=lambda i: -len(" ".join(words[i].split())))
    groups = [""] * len(words)
    for i in range(len(words)):
        groups[i] = r"\s+".join(re.escape(part) for part in words[i].split())
    # Group numbers follow the order of appearance in the pattern, so name them to find the entry back.
    alternatives = "|".join(f"(?P<w{i}>{groups[i]})" for i in order)
    return re.compile(rf"(?<![\w-])(?:{alternatives})(?![\w-])", re.IGNORECASE)


def _reflection_update(
    responses: Sequence[str], pattern: re.Pattern[str], num_words: int, device: torch.device | None = None
) -> tuple[Tensor, Tensor]:
    """Response texts -> (count of each word [num_words] int64, number of responses)."""
    counts = [0] * num_words
    for text in responses:
        for match in pattern.finditer(text):
            counts[int(match.lastgroup[1:])] += 1
    return (
        torch.tensor(counts, dtype=_COUNT, device=device),
        torch.tensor(len(responses), dtype=_COUNT, device=device),
    )


def _reflection_compute(counts: Tensor, num_responses: Tensor, words: Sequence[str]) -> dict[str, Tensor]:
    out = {"reflection/per_response": _ratio(counts.sum(), num_responses)}
    for i, word in enumerate(words):
        out[reflection_key(word)] = _ratio(counts[i], num_responses)
    return out


# ------------------------------------------------------------------------------- pass@k, avg@n, distinct


def _samples_and_correct(num_samples: Tensor | int, num_correct: Tensor) -> tuple[Tensor, Tensor]:
    c = torch.as_tensor(num_correct).reshape(-1).to(_COUNT)
    n = torch.as_tensor(num_samples, device=c.device).to(_COUNT)
    n = n.expand(c.shape) if n.dim() == 0 else n.reshape(-1)
    if n.shape != c.shape:
        raise ValueError(f"num_samples has {n.numel()} prompts, num_correct has {c.numel()}")
    if c.numel() and (bool((c < 0).any()) or bool((c > n).any())):
        raise ValueError("every prompt needs 0 <= num_correct <= num_samples")
    return n, c


def _avg_at_n_update(num_samples: Tensor | int, num_correct: Tensor) -> tuple[Tensor, Tensor]:
    """Per prompt n and c -> (sum over prompts of c / n, number of prompts)."""
    n, c = _samples_and_correct(num_samples, num_correct)
    if n.numel() and bool((n < 1).any()):
        raise ValueError("every prompt needs at least one sample")
    return (c.to(_SUM) / n.to(_SUM)).sum(), torch.tensor(n.numel(), dtype=_COUNT, device=n.device)


def _avg_at_n_compute(total: Tensor, num_prompts: Tensor) -> dict[str, Tensor]:
    return {"avg@n": _ratio(total, num_prompts)}


def _pass_at_k_per_prompt(n: Tensor, c: Tensor, k: int) -> Tensor:
    """Unbiased pass@k per prompt: 1 - prod_{i=n-c+1}^{n} (1 - k / i) (1 when n - c < k)."""
    if n.numel() == 0:
        return torch.zeros(0, dtype=_SUM, device=n.device)
    i = torch.arange(1, int(n.max()) + 1, dtype=_SUM, device=n.device).unsqueeze(0)
    in_product = (i > (n - c).unsqueeze(-1).to(_SUM)) & (i <= n.unsqueeze(-1).to(_SUM))
    factors = torch.where(in_product, 1.0 - k / i, torch.ones_like(i))
    return 1.0 - factors.prod(dim=-1)


def _pass_at_k_update(num_samples: Tensor | int, num_correct: Tensor, ks: Sequence[int]) -> tuple[Tensor, Tensor]:
    """Per prompt n and c -> (sum over prompts of pass@k for each k [len(ks)], number of prompts)."""
    n, c = _samples_and_correct(num_samples, num_correct)
    for k in ks:
        if int(k) < 1:
            raise ValueError(f"pass@k needs k >= 1, got {k}")
        if n.numel() and bool((n < k).any()):
            raise ValueError(f"pass@{k} needs k <= n for every prompt; smallest n is {int(n.min())}")
    sums = torch.stack([_pass_at_k_per_prompt(n, c, int(k)).sum() for k in ks]) if ks else torch.zeros(0)
    return sums.to(_SUM), torch.tensor(n.numel(), dtype=_COUNT, device=n.device)


def _pass_at_k_compute(sums: Tensor, num_prompts: Tensor, ks: Sequence[int]) -> dict[str, Tensor]:
    return {f"pass@{int(k)}": _ratio(sums[j], num_prompts) for j, k in enumerate(ks)}


def _distinct_correct_update(
    responses: Sequence[Sequence[str]], correct: Sequence[Sequence[bool]] | Tensor, device: torch.device | None = None
) -> tuple[Tensor, Tensor]:
    """Responses grouped per prompt and their correctness -> (sum of distinct correct counts, prompts).

    Texts are compared after stripping leading and trailing whitespace. Each group is one prompt.
    """
    if len(responses) != len(correct):
        raise ValueError(f"{len(responses)} response groups but {len(correct)} correctness groups")
    total = 0
    for texts, flags in zip(responses, correct):
        flags = flags.tolist() if isinstance(flags, Tensor) else list(flags)
        if len(texts) != len(flags):
            raise ValueError(f"a group has {len(texts)} responses but {len(flags)} correctness flags")
        total += len({t.strip() for t, ok in zip(texts, flags) if ok})
    return (
        torch.tensor(total, dtype=_COUNT, device=device),
        torch.tensor(len(responses), dtype=_COUNT, device=device),
    )


def _distinct_correct_compute(total: Tensor, num_prompts: Tensor) -> dict[str, Tensor]:
    return {"distinct_correct": _ratio(total, num_prompts)}
