"""STARE token weights and their selection scopes.

What it implements: STARE (Surprisal-guided Token-level Advantage Reweighting for policy Entropy
stability; Luo et al. 2026, arXiv 2606.19236), docs/method.md section 3.
Valid response tokens are split by advantage sign, T+ = {A > 0} and T- = {A < 0} (A = 0 is never
selected). Within each set the tokens are ranked by surprisal -log pi(o), highest first, and the top
k = max(1, ceil(P |T|)), capped at |T|, form L+ and L-. Weights: omega = W on L+ (variant O1), and
also omega = M on L- (variant C2), omega = 1 elsewhere. When the gate is off every weight is 1.
The gate and the (adaptive) W and M come from ``stare_controller.STAREController``.

Conventions this module fixes where the paper leaves room:
- P = 0 selects nothing (the max(1, .) floor applies only for P > 0); an empty set selects nothing.
- Ties in the ranking score are broken by position: the earlier token in row-major order of the
  batch (rank order first when gathered across ranks) wins. Ceil(P |T|) is computed with a 1e-7
  tolerance so that, e.g., 0.1 * 30 gives 3, not 4; ``k_rounding="reference"`` takes the reference code's
  int(P |T| + 0.999999) instead (the two differ only when P |T| lies within 1e-6 above an integer).
  ``tie_order="topk"`` takes the reference code's order among exactly tied scores: whatever ``torch.topk``
  returns for the set's float32 scores in row-major order (unspecified by torch and device-dependent, so
  it equals the reference's on the same device and torch, and is not itself a documented order).
- Weights are 1 at masked positions (the loss masks them anyway; 1 keeps "all ones = GRPO").
- The selection is computed even when the gate is off (for telemetry); only the weights ignore it.

Departures from the paper and its reference code (which selects inside each micro-batch on each
GPU): the default scope is the whole step batch, gathered across ranks, so the weights do not depend
on the micro-batch size nor on the number of devices; `micro_batch`, `sequence` and `group` scopes
are also offered. A `sensitivity` selector ranks by the exact entropy sensitivity Phi instead of
surprisal; what ranks the tokens is a registry (``selectors/``: surprisal, sensitivity, the predictive entropy and a
seeded random control). Settings are range-checked once, by ``AlgorithmConfig``; these functions check shapes only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from stare_lightning.algorithms.selectors import STARE_SELECTORS, RankingInputs
from stare_lightning.algorithms.surrogates import broadcast_advantages
from stare_lightning.distributed import gather_variable_length
from stare_lightning.distributed import rank as global_rank

__all__ = [
    "STARE_SCOPES",
    "STARE_SELECTORS",
    "STARE_VARIANTS",
    "STARERule",
    "STAREStats",
    "stare_token_weights",
    "stare_weights_for_scope",
]

STARE_VARIANTS = ("O1", "C2")
STARE_SCOPES = ("step", "micro_batch", "sequence", "group")

_CEIL_TOL = 1e-7


@dataclass
class STAREStats:
    """Selection counts over the valid tokens given (float32 0-d tensors, summable across micro-batches and ranks).

    selected_pos = |L+|, selected_neg = |L-|, num_pos = |T+|, num_neg = |T-|, num_valid = valid tokens;
    selected: bool [B, T], True on L+ and L- (split them with the sign of A); gate_on: the gate used.
    For scope "step" the counts are this caller's share of the step-wide selection.
    """

    selected_pos: Tensor
    selected_neg: Tensor
    num_pos: Tensor
    num_neg: Tensor
    num_valid: Tensor
    selected: Tensor
    gate_on: bool


@dataclass(frozen=True)
class STARERule:
    """How one selection ranks and weights tokens: the variant, P, W, M, the gate and the ranking's conventions.

    variant: "O1" (omega = W on L+) or "C2" (also omega = M on L-); top_ratio: P; gate_on: False gives every
    weight 1 (the selection is still made, for telemetry); selector: a ``STARE_SELECTORS`` name (what ranks the
    tokens); k_rounding: "ceil" (ceil(P n) with a 1e-7 tolerance) or "reference" (int(P n + 0.999999), the
    reference code's); tie_order: "position" (the earlier token wins a tie) or "topk" (torch.topk's order, the
    reference code's). Range checks belong to ``STAREConfig``; a rule is built from checked settings.
    """

    variant: str = "O1"
    top_ratio: float = 0.1
    w: float = 1.1
    m: float = 0.9
    gate_on: bool = True
    selector: str = "surprisal"
    k_rounding: str = "ceil"
    tie_order: str = "position"

    @classmethod
    def of(cls, **settings) -> STARERule:
        """A rule from keyword settings, naming any that is not a rule field."""
        unknown = set(settings) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(
                f"unknown STARE arguments {sorted(unknown)}: a rule takes {sorted(cls.__dataclass_fields__)}"
            )
        return cls(**settings)

    def ranking(self) -> tuple[float, str, str]:
        """The arguments of ``_select_top`` after the segments: P, the k rule and the tie order."""
        return self.top_ratio, self.k_rounding, self.tie_order


def _select_top(
    scores: Tensor,
    adv: Tensor,
    seg: Tensor | None,
    num_seg: int,
    top_ratio: float,
    k_rounding: str = "ceil",
    tie_order: str = "position",
) -> tuple[Tensor, Tensor]:
    """L+ and L- membership (bool [N]) over a 1-D stream of valid tokens, selected within each segment.

    Tokens are ordered by (segment, score descending, stream position); the first k of each
    (segment, sign) set are taken, k = min(n, max(1, ceil(P n))) for n > 0. ``tie_order="topk"``:
    each set's k come from ``torch.topk`` instead (its order among ties).
    """
    n_tok = scores.shape[0]
    device = scores.device
    sel_pos = torch.zeros(n_tok, dtype=torch.bool, device=device)
    sel_neg = torch.zeros(n_tok, dtype=torch.bool, device=device)
    if n_tok == 0 or top_ratio == 0:
        return sel_pos, sel_neg
    if seg is None:
        seg = torch.zeros(n_tok, dtype=torch.long, device=device)
        num_seg = 1
    order = torch.sort(scores, descending=True, stable=True).indices
    order = order[torch.sort(seg[order], stable=True).indices]
    seg_sorted = seg[order]
    for member, out in ((adv > 0, sel_pos), (adv < 0, sel_neg)):
        counts = torch.bincount(seg[member], minlength=num_seg)
        share = counts.to(torch.float64) * top_ratio
        k = torch.floor(share + 0.999999) if k_rounding == "reference" else torch.ceil(share - _CEIL_TOL)
        k = k.clamp(min=1).to(torch.long)
        k = torch.minimum(k, counts)
        if tie_order == "topk":
            for segment in counts.nonzero().flatten().tolist():
                candidates = (member & (seg == segment)).nonzero().flatten()
                top = torch.topk(scores[candidates].float(), int(k[segment])).indices
                out[candidates[top]] = True
            continue
        first = torch.cumsum(counts, 0) - counts  # members in earlier segments
        m_sorted = member[order]
        rank = torch.cumsum(m_sorted.to(torch.long), 0) - 1 - first[seg_sorted]
        out[order] = m_sorted & (rank < k[seg_sorted])
    return sel_pos, sel_neg


@dataclass
class _Stream:
    """The valid tokens of several [B_i, T_i] parts as one 1-D stream, in row-major order part by part."""

    scores: Tensor  # float64 ranking score (surprisal or Phi)
    advantages: Tensor  # float64
    segments: Tensor | None  # segment id of each token, None when there is one segment
    valid: list[Tensor]  # bool [B_i, T_i] per part
    advantages_full: list[Tensor]  # [B_i, T_i] per part


def _stream(logprobs, advantages, masks, extras, selector, seg_of_row, num_seg, device) -> _Stream:
    """``extras``: per part, the ``RankingInputs`` fields beyond the log-probs (phi, entropy, generator)."""
    rank_by = STARE_SELECTORS[selector]
    scores, advs, segs, valids, advs_full = [], [], [], [], []
    row0 = 0
    for i, (lp, a, mk) in enumerate(zip(logprobs, advantages, masks)):
        if lp.dim() != 2:
            raise ValueError(f"logprobs has shape {tuple(lp.shape)}; expected [B, T]")
        if mk.shape != lp.shape:
            raise ValueError(f"mask has shape {tuple(mk.shape)}; expected {tuple(lp.shape)}")
        a_full = broadcast_advantages(a, lp)
        valid = mk.to(torch.bool)
        score = rank_by.score(RankingInputs(logprobs=lp, **extras[i]))
        scores.append(score[valid])
        advs.append(a_full.detach()[valid].to(torch.float64))
        rows = torch.arange(lp.shape[0], device=lp.device).unsqueeze(1).expand_as(lp)
        segs.append(seg_of_row(i, row0, lp.shape[0])[rows[valid]] if num_seg > 1 else None)
        valids.append(valid)
        advs_full.append(a_full)
        row0 += lp.shape[0]
    empty = torch.zeros(0, dtype=torch.float64, device=device)
    return _Stream(
        scores=torch.cat(scores) if scores else empty,
        advantages=torch.cat(advs) if advs else empty,
        segments=torch.cat(segs) if num_seg > 1 else None,
        valid=valids,
        advantages_full=advs_full,
    )


def _part_results(
    stream: _Stream, sel_pos: Tensor, sel_neg: Tensor, rule: STARERule
) -> tuple[list[Tensor], list[STAREStats]]:
    """Split the stream's selection back into per-part weights and stats."""
    weights_out, stats_out = [], []
    start = 0
    for valid, a_full in zip(stream.valid, stream.advantages_full):
        n = int(valid.sum().item())
        sp, sn = sel_pos[start : start + n], sel_neg[start : start + n]
        start += n
        weights = torch.ones(valid.shape, dtype=torch.float32, device=valid.device)
        if rule.gate_on:
            vals = torch.ones(n, dtype=torch.float32, device=valid.device)
            vals[sp] = float(rule.w)
            if rule.variant == "C2":
                vals[sn] = float(rule.m)
            weights[valid] = vals
        selected = torch.zeros(valid.shape, dtype=torch.bool, device=valid.device)
        selected[valid] = sp | sn
        stats_out.append(
            STAREStats(
                selected_pos=sp.sum().to(torch.float32),
                selected_neg=sn.sum().to(torch.float32),
                num_pos=(valid & (a_full > 0)).sum().to(torch.float32),
                num_neg=(valid & (a_full < 0)).sum().to(torch.float32),
                num_valid=valid.sum().to(torch.float32),
                selected=selected,
                gate_on=bool(rule.gate_on),
            )
        )
        weights_out.append(weights)
    return weights_out, stats_out


def _select(
    stream: _Stream, num_seg: int, rule: STARERule, gather: Callable[[Tensor], Tensor] | None, rank: int | None
) -> tuple[Tensor, Tensor]:
    """Select within each segment locally, or (``gather`` given) over all ranks' streams concatenated."""
    if gather is None:
        return _select_top(stream.scores, stream.advantages, stream.segments, num_seg, *rule.ranking())
    n_local = stream.scores.numel()
    lengths = gather(torch.tensor([n_local], dtype=torch.float64, device=stream.scores.device))
    offset = int(lengths[: global_rank() if rank is None else rank].sum().item())
    sel_pos, sel_neg = _select_top(gather(stream.scores), gather(stream.advantages), None, 1, *rule.ranking())
    return sel_pos[offset : offset + n_local], sel_neg[offset : offset + n_local]


def stare_token_weights(
    logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    sensitivity: Tensor | None = None,
    entropy: Tensor | None = None,
    generator: torch.Generator | None = None,
    rule: STARERule | None = None,
    **settings,
) -> tuple[Tensor, STAREStats]:
    """STARE weights [B, T] (float32, no gradient) selected over exactly the tokens given.

    logprobs: [B, T] log pi(o) (surprisal = -logprobs); advantages: [B] or [B, T]; mask: [B, T];
    sensitivity: Phi [B, T], required when selector == "sensitivity" (rank by Phi, highest first); entropy: the
    predictive entropy [B, T], required by selector "entropy"; generator: the draw of selector "random".
    ``rule``: a ``STARERule``, or its fields as keyword ``settings`` (variant="C2", top_ratio=0.2, ...).
    """
    if rule is not None and settings:
        raise ValueError(f"pass a STARERule or its settings {sorted(settings)}, not both")
    weights, stats = stare_weights_for_scope(
        [logprobs],
        [advantages],
        [mask],
        rule=rule if rule is not None else STARERule.of(**settings),
        scope="micro_batch",
        sensitivity=None if sensitivity is None else [sensitivity],
        entropy=None if entropy is None else [entropy],
        generator=generator,
    )
    return weights[0], stats[0]


def _segments(scope: str, num_parts: int, total_rows: int, group_size: int | None, device):
    """(number of segments, segment id of each row of part i starting at global row r0)."""
    if scope in ("step", "micro_batch") and (scope == "step" or num_parts == 1):
        return 1, lambda i, r0, b: torch.zeros(b, dtype=torch.long, device=device)
    if scope == "micro_batch":
        return num_parts, lambda i, r0, b: torch.full((b,), i, dtype=torch.long, device=device)
    if scope == "sequence":
        return total_rows, lambda i, r0, b: torch.arange(r0, r0 + b, dtype=torch.long, device=device)
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1 or total_rows % group_size:
        raise ValueError(
            f"group_size={group_size!r} must be an integer >= 1 dividing the number of rows ({total_rows})"
        )
    return (
        total_rows // group_size,
        lambda i, r0, b: torch.arange(r0, r0 + b, dtype=torch.long, device=device) // group_size,
    )


def stare_weights_for_scope(
    logprobs: Sequence[Tensor],
    advantages: Sequence[Tensor],
    mask: Sequence[Tensor],
    *,
    rule: STARERule,
    scope: str = "step",
    group_size: int | None = None,
    gather: Callable[[Tensor], Tensor] | None = None,
    rank: int | None = None,
    sensitivity: Sequence[Tensor] | None = None,
    entropy: Sequence[Tensor] | None = None,
    generator: torch.Generator | None = None,
) -> tuple[list[Tensor], list[STAREStats]]:
    """STARE weights with the selection scope made explicit, for a sequence of parts.

    Inputs are sequences of [B_i, T_i] tensors, one per part (e.g. the step's micro-batches, each with its own
    padding; one part for a single batch); advantages may be [B_i]. The output is one weights tensor and one
    ``STAREStats`` per part. ``rule``: the ``STARERule`` (``STARERule.of(...)`` builds one from keywords).
    scope: "step", one selection over all valid tokens given, concatenated across ranks by `gather`
    (default `gather_variable_length`, the identity on one process; `gather=lambda t: t` stays local;
    `rank` is this process's place in that concatenation, by default its global rank; every rank must
    call it); "micro_batch", a separate selection inside each part (the reference code's behaviour);
    "sequence", inside each row; "group", inside each block of `group_size` consecutive rows counted
    across the parts (the rows must be a multiple of group_size). Only "step" communicates.
    """
    if scope not in STARE_SCOPES:
        raise ValueError(f"scope={scope!r} is not allowed: choose one of {STARE_SCOPES}")
    if not isinstance(rule, STARERule):
        raise ValueError(f"rule={rule!r} is not allowed: pass a STARERule (STARERule.of(...) builds one)")
    named = {"logprobs": logprobs, "advantages": advantages, "mask": mask, "sensitivity": sensitivity}
    for name, value in {**named, "entropy": entropy}.items():
        if isinstance(value, Tensor):
            raise ValueError(f"{name} is one tensor: pass a list of [B, T] tensors, one per part ([{name}])")
    lps, advs, masks = list(logprobs), list(advantages), list(mask)
    sens = None if sensitivity is None else list(sensitivity)
    ents = None if entropy is None else list(entropy)
    if not (len(lps) == len(advs) == len(masks)) or any(x is not None and len(x) != len(lps) for x in (sens, ents)):
        raise ValueError("logprobs, advantages, mask (and sensitivity, entropy) must have the same number of parts")
    extras = [
        {"phi": None if sens is None else sens[i], "entropy": None if ents is None else ents[i], "generator": generator}
        for i in range(len(lps))
    ]
    device = lps[0].device if lps else torch.device("cpu")
    num_seg, seg_of_row = _segments(scope, len(lps), sum(x.shape[0] for x in lps), group_size, device)
    with torch.no_grad():
        stream = _stream(lps, advs, masks, extras, rule.selector, seg_of_row, num_seg, device)
        step_gather = (gather or gather_variable_length) if scope == "step" else None
        sel_pos, sel_neg = _select(stream, num_seg, rule, step_gather, rank)
        return _part_results(stream, sel_pos, sel_neg, rule)
