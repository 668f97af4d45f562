"""STARE token weights, their selection scopes and the entropy-gated controller.

What it implements: STARE (Surprisal-guided Token-level Advantage Reweighting for policy Entropy
stability; Luo et al. 2026, arXiv 2606.19236), section 3 of docs/stare-method.md.
Valid response tokens are split by advantage sign, T+ = {A > 0} and T- = {A < 0} (A = 0 is never
selected). Within each set the tokens are ranked by surprisal -log pi(o), highest first, and the top
k = max(1, ceil(P |T|)), capped at |T|, form L+ and L-. Weights: omega = W on L+ (variant O1), and
also omega = M on L- (variant C2), omega = 1 elsewhere. When the gate is off every weight is 1.
The controller opens the gate when the measured entropy is strictly below the target and, when
adaptive, moves W up and M down by alpha while entropy is below target (and back otherwise),
clipped to [1, w_max] and [m_min, 1].

Conventions this module fixes where the paper leaves room:
- P = 0 selects nothing (the max(1, .) floor applies only for P > 0); an empty set selects nothing.
- Ties in the ranking score are broken by position: the earlier token in row-major order of the
  batch (rank order first when gathered across ranks) wins. Ceil(P |T|) is computed with a 1e-7
  tolerance so that, e.g., 0.1 * 30 gives 3, not 4.
- Weights are 1 at masked positions (the loss masks them anyway; 1 keeps "all ones = GRPO").
- The selection is computed even when the gate is off (for telemetry); only the weights ignore it.

Departures from the paper and its reference code (which selects inside each micro-batch on each
GPU): the default scope is the whole step batch, gathered across ranks, so the weights do not depend
on the micro-batch size nor on the number of devices; `micro_batch`, `sequence` and `group` scopes
are also offered. A `sensitivity` selector ranks by the exact entropy sensitivity Phi instead of
surprisal. The adaptive W/M apply from the step after the measurement by default (the paper's
formula); `timing="same_step"` reproduces the reference code, which applies them at once.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
from torch import Tensor

from stare_lightning.algorithms.surrogates import broadcast_advantages

__all__ = [
    "STARE_VARIANTS",
    "STARE_SELECTORS",
    "STARE_SCOPES",
    "STARE_TIMINGS",
    "StareStats",
    "StepParams",
    "STAREController",
    "gather_variable_length",
    "stare_token_weights",
    "stare_weights_for_scope",
]

STARE_VARIANTS = ("O1", "C2")
STARE_SELECTORS = ("surprisal", "sensitivity")
STARE_SCOPES = ("step", "micro_batch", "sequence", "group")
STARE_TIMINGS = ("next_step", "same_step")

_CEIL_TOL = 1e-7


@dataclass
class StareStats:
    """Selection counts over the valid tokens given (float32 0-d tensors, summable across micro-batches and ranks).

    selected_pos = |L+|, selected_neg = |L-|, num_pos = |T+|, num_neg = |T-|, num_valid = valid tokens;
    selected: bool [B, T], True on L+ and L- (split them with the sign of A); gate_on: the gate used.
    selected_frac/pos = selected_pos / num_pos (once summed over the step).
    For scope "step" the counts are this caller's share of the step-wide selection.
    """

    selected_pos: Tensor
    selected_neg: Tensor
    num_pos: Tensor
    num_neg: Tensor
    num_valid: Tensor
    selected: Tensor
    gate_on: bool


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _check_stare_args(variant: str, top_ratio: float, w: float, m: float, selector: str) -> None:
    if variant not in STARE_VARIANTS:
        raise ValueError(f"variant={variant!r} is not allowed: choose one of {STARE_VARIANTS}")
    if not _is_number(top_ratio) or not 0.0 <= top_ratio <= 1.0:
        raise ValueError(f"top_ratio={top_ratio!r} is out of range: must be a number in [0, 1]")
    if not _is_number(w) or not (math.isfinite(w) and w > 0):
        raise ValueError(f"w={w!r} is out of range: must be a finite number > 0 (a weight never flips a gradient)")
    if not _is_number(m) or not (math.isfinite(m) and m > 0):
        raise ValueError(f"m={m!r} is out of range: must be a finite number > 0 (a weight never flips a gradient)")
    if selector not in STARE_SELECTORS:
        raise ValueError(f"selector={selector!r} is not allowed: choose one of {STARE_SELECTORS}")


def _select_top(scores: Tensor, adv: Tensor, seg: Optional[Tensor], num_seg: int, top_ratio: float
                ) -> Tuple[Tensor, Tensor]:
    """L+ and L- membership (bool [N]) over a 1-D stream of valid tokens, selected within each segment.

    Tokens are ordered by (segment, score descending, stream position); the first k of each
    (segment, sign) set are taken, k = min(n, max(1, ceil(P n))) for n > 0.
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
        k = torch.ceil(counts.to(torch.float64) * top_ratio - _CEIL_TOL).clamp(min=1).to(torch.long)
        k = torch.minimum(k, counts)
        first = torch.cumsum(counts, 0) - counts  # members in earlier segments
        m_sorted = member[order]
        rank = torch.cumsum(m_sorted.to(torch.long), 0) - 1 - first[seg_sorted]
        out[order] = m_sorted & (rank < k[seg_sorted])
    return sel_pos, sel_neg


def gather_variable_length(t: Tensor) -> Tensor:
    """All ranks' 1-D tensors concatenated in rank order; `t` itself when torch.distributed is not initialised.

    Pads each rank's tensor to the longest with zeros for `all_gather`, then strips the padding.
    Every rank of the default process group must call it. No gradient flows through it.
    """
    if t.dim() != 1:
        raise ValueError(f"t has shape {tuple(t.shape)}; expected a 1-D tensor")
    if not (dist.is_available() and dist.is_initialized()):
        return t
    world = dist.get_world_size()
    if world == 1:
        return t
    n = torch.tensor([t.numel()], dtype=torch.long, device=t.device)
    sizes = [torch.zeros_like(n) for _ in range(world)]
    dist.all_gather(sizes, n)
    lengths = [int(s.item()) for s in sizes]
    longest = max(lengths)
    if longest == 0:
        return t
    padded = torch.zeros(longest, dtype=t.dtype, device=t.device)
    padded[: t.numel()] = t.detach()
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded)
    return torch.cat([p[:k] for p, k in zip(parts, lengths)])


TensorOrList = Union[Tensor, Sequence[Tensor]]


def _weights_from_parts(
    logprobs: List[Tensor],
    advantages: List[Tensor],
    masks: List[Tensor],
    sensitivity: Optional[List[Tensor]],
    *,
    seg_of_row: Callable[[int, int, int], Tensor],
    num_seg: int,
    gather: Optional[Callable[[Tensor], Tensor]],
    rank: Optional[int],
    variant: str,
    top_ratio: float,
    w: float,
    m: float,
    gate_on: bool,
    selector: str,
    device: torch.device,
) -> Tuple[List[Tensor], List[StareStats]]:
    """Selection over the concatenated valid-token streams of several [B_i, T_i] parts."""
    scores, advs, segs, valids, advs_full = [], [], [], [], []
    row0 = 0
    for i, (lp, a, mk) in enumerate(zip(logprobs, advantages, masks)):
        if lp.dim() != 2:
            raise ValueError(f"logprobs has shape {tuple(lp.shape)}; expected [B, T]")
        if mk.shape != lp.shape:
            raise ValueError(f"mask has shape {tuple(mk.shape)}; expected {tuple(lp.shape)}")
        a_full = broadcast_advantages(a, lp)
        valid = mk.to(torch.bool)
        if selector == "sensitivity":
            if sensitivity is None or sensitivity[i] is None:
                raise ValueError("sensitivity=None is not allowed with selector='sensitivity': pass Phi per token")
            if sensitivity[i].shape != lp.shape:
                raise ValueError(f"sensitivity has shape {tuple(sensitivity[i].shape)}; expected {tuple(lp.shape)}")
            score = sensitivity[i].detach().to(torch.float64)
        else:
            score = -lp.detach().to(torch.float64)
        scores.append(score[valid])
        advs.append(a_full.detach()[valid].to(torch.float64))
        rows = torch.arange(lp.shape[0], device=lp.device).unsqueeze(1).expand_as(lp)
        segs.append(seg_of_row(i, row0, lp.shape[0])[rows[valid]] if num_seg > 1 else None)
        valids.append(valid)
        advs_full.append(a_full)
        row0 += lp.shape[0]
    local_scores = torch.cat(scores) if scores else torch.zeros(0, dtype=torch.float64, device=device)
    local_adv = torch.cat(advs) if advs else torch.zeros(0, dtype=torch.float64, device=device)
    local_seg = torch.cat(segs) if num_seg > 1 else None

    if gather is not None:
        n_local = local_scores.numel()
        lengths = gather(torch.tensor([n_local], dtype=torch.float64, device=local_scores.device))
        if rank is None:
            rank = dist.get_rank() if (dist.is_available() and dist.is_initialized()) else 0
        offset = int(lengths[:rank].sum().item())
        all_scores = gather(local_scores)
        all_adv = gather(local_adv)
        sel_pos, sel_neg = _select_top(all_scores, all_adv, None, 1, top_ratio)
        sel_pos = sel_pos[offset: offset + n_local]
        sel_neg = sel_neg[offset: offset + n_local]
    else:
        sel_pos, sel_neg = _select_top(local_scores, local_adv, local_seg, num_seg, top_ratio)

    weights_out, stats_out = [], []
    start = 0
    for valid, a_full in zip(valids, advs_full):
        n = int(valid.sum().item())
        sp, sn = sel_pos[start: start + n], sel_neg[start: start + n]
        start += n
        weights = torch.ones(valid.shape, dtype=torch.float32, device=valid.device)
        if gate_on:
            vals = torch.ones(n, dtype=torch.float32, device=valid.device)
            vals[sp] = float(w)
            if variant == "C2":
                vals[sn] = float(m)
            weights[valid] = vals
        selected = torch.zeros(valid.shape, dtype=torch.bool, device=valid.device)
        selected[valid] = sp | sn
        stats_out.append(StareStats(
            selected_pos=sp.sum().to(torch.float32),
            selected_neg=sn.sum().to(torch.float32),
            num_pos=(valid & (a_full > 0)).sum().to(torch.float32),
            num_neg=(valid & (a_full < 0)).sum().to(torch.float32),
            num_valid=valid.sum().to(torch.float32),
            selected=selected,
            gate_on=bool(gate_on),
        ))
        weights_out.append(weights)
    return weights_out, stats_out


def stare_token_weights(
    logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    variant: str = "O1",
    top_ratio: float = 0.1,
    w: float = 1.1,
    m: float = 0.9,
    gate_on: bool = True,
    selector: str = "surprisal",
    sensitivity: Optional[Tensor] = None,
) -> Tuple[Tensor, StareStats]:
    """STARE weights [B, T] (float32, no gradient) selected over exactly the tokens given.

    logprobs: [B, T] log pi(o) (surprisal = -logprobs); advantages: [B] or [B, T]; mask: [B, T];
    sensitivity: Phi [B, T], required when selector == "sensitivity" (rank by Phi, highest first).
    """
    _check_stare_args(variant, top_ratio, w, m, selector)
    with torch.no_grad():
        weights, stats = _weights_from_parts(
            [logprobs], [advantages], [mask], None if sensitivity is None else [sensitivity],
            seg_of_row=lambda i, r0, b: torch.zeros(b, dtype=torch.long), num_seg=1, gather=None, rank=None,
            variant=variant, top_ratio=top_ratio, w=w, m=m, gate_on=gate_on, selector=selector,
            device=logprobs.device,
        )
    return weights[0], stats[0]


def stare_weights_for_scope(
    logprobs: TensorOrList,
    advantages: TensorOrList,
    mask: TensorOrList,
    *,
    scope: str = "step",
    group_size: Optional[int] = None,
    gather: Optional[Callable[[Tensor], Tensor]] = None,
    rank: Optional[int] = None,
    **stare_kwargs,
):
    """STARE weights with the selection scope made explicit.

    Inputs are [B, T] tensors, or lists of them (e.g. the step's micro-batches, each with its own
    padding); the output has the same structure: (weights, stats) or ([weights...], [stats...]).
    scope:
      "step": one selection over all valid tokens given, concatenated across ranks by `gather`
        (default `gather_variable_length`, the identity when torch.distributed is not initialised;
        pass `gather=lambda t: t` to stay local). The weights do not depend on how the tokens are
        split into parts, on padding, nor on the number of ranks. Every rank must call it.
        `rank` is this process's index in `gather`'s concatenation (default: the global rank).
        The other scopes never communicate and ignore `gather` and `rank`.
      "micro_batch": a separate selection inside each part (the reference code's behaviour).
      "sequence": a separate selection inside each row.
      "group": a separate selection inside each block of `group_size` consecutive rows, counted
        across the parts in order (the total number of rows must be a multiple of group_size).
    Remaining keyword arguments are those of `stare_token_weights`.
    """
    if scope not in STARE_SCOPES:
        raise ValueError(f"scope={scope!r} is not allowed: choose one of {STARE_SCOPES}")
    unknown = set(stare_kwargs) - {"variant", "top_ratio", "w", "m", "gate_on", "selector", "sensitivity"}
    if unknown:
        raise ValueError(f"unknown STARE arguments {sorted(unknown)}")
    variant = stare_kwargs.get("variant", "O1")
    top_ratio = stare_kwargs.get("top_ratio", 0.1)
    w = stare_kwargs.get("w", 1.1)
    m = stare_kwargs.get("m", 0.9)
    gate_on = stare_kwargs.get("gate_on", True)
    selector = stare_kwargs.get("selector", "surprisal")
    sensitivity = stare_kwargs.get("sensitivity", None)
    _check_stare_args(variant, top_ratio, w, m, selector)

    single = isinstance(logprobs, Tensor)
    lps = [logprobs] if single else list(logprobs)
    advs = [advantages] if single else list(advantages)
    masks = [mask] if single else list(mask)
    if sensitivity is not None:
        sens = [sensitivity] if single else list(sensitivity)
    else:
        sens = None
    if not (len(lps) == len(advs) == len(masks)) or (sens is not None and len(sens) != len(lps)):
        raise ValueError("logprobs, advantages, mask (and sensitivity) must have the same number of parts")
    rows = [x.shape[0] for x in lps]
    total_rows = sum(rows)
    device = lps[0].device if lps else torch.device("cpu")

    gather_fn = None
    if scope == "step":
        num_seg = 1
        gather_fn = gather if gather is not None else gather_variable_length

        def seg_of_row(i, r0, b):
            return torch.zeros(b, dtype=torch.long, device=device)
    elif scope == "micro_batch":
        num_seg = len(lps)

        def seg_of_row(i, r0, b):
            return torch.full((b,), i, dtype=torch.long, device=device)
    elif scope == "sequence":
        num_seg = total_rows

        def seg_of_row(i, r0, b):
            return torch.arange(r0, r0 + b, dtype=torch.long, device=device)
    else:
        if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
            raise ValueError(f"group_size={group_size!r} is out of range: scope 'group' needs an integer >= 1")
        if total_rows % group_size != 0:
            raise ValueError(f"group_size={group_size} does not divide the number of rows ({total_rows})")
        num_seg = total_rows // group_size

        def seg_of_row(i, r0, b):
            return torch.arange(r0, r0 + b, dtype=torch.long, device=device) // group_size

    with torch.no_grad():
        weights, stats = _weights_from_parts(
            lps, advs, masks, sens, seg_of_row=seg_of_row, num_seg=max(num_seg, 1), gather=gather_fn, rank=rank,
            variant=variant, top_ratio=top_ratio, w=w, m=m, gate_on=gate_on, selector=selector, device=device,
        )
    if single:
        return weights[0], stats[0]
    return weights, stats


@dataclass
class StepParams:
    """What STARE uses in one step: the gate and the weights W (on L+) and M (on L-)."""

    gate_on: bool
    w: float
    m: float


class STAREController:
    """Entropy gate and (optionally adaptive) weights, one `update` per optimizer step.

    update(H) measures the step's batch entropy H and returns the StepParams for THIS step:
    gate_on = H < target_entropy (strict). When adaptive, W <- clip(W + alpha sign(H_tgt - H), 1, w_max)
    and M <- clip(M - alpha sign(H_tgt - H), m_min, 1); with timing "next_step" this step uses the
    values from before the update, with "same_step" the updated values.
    Attributes: gate_on, w, m (the values the NEXT update starts from), last_entropy, last_params.
    A non-finite entropy leaves the state unchanged, warns, and returns the previous step's params.
    """

    def __init__(
        self,
        target_entropy: float = 0.3,
        w: float = 1.1,
        m: float = 0.9,
        adaptive: bool = False,
        alpha: float = 0.01,
        w_max: float = 1.5,
        m_min: float = 0.5,
        timing: str = "next_step",
    ) -> None:
        if not _is_number(target_entropy) or not (math.isfinite(target_entropy) and target_entropy >= 0):
            raise ValueError(f"target_entropy={target_entropy!r} is out of range: must be a finite number >= 0")
        if not _is_number(alpha) or not (math.isfinite(alpha) and alpha >= 0):
            raise ValueError(f"alpha={alpha!r} is out of range: must be a finite number >= 0")
        if not _is_number(w_max) or not (math.isfinite(w_max) and w_max >= 1):
            raise ValueError(f"w_max={w_max!r} is out of range: must be a finite number >= 1")
        if not _is_number(m_min) or not (0 < m_min <= 1):
            raise ValueError(f"m_min={m_min!r} is out of range: must be a number in (0, 1]")
        if not _is_number(w) or not (math.isfinite(w) and w > 0):
            raise ValueError(f"w={w!r} is out of range: must be a finite number > 0")
        if not _is_number(m) or not (math.isfinite(m) and m > 0):
            raise ValueError(f"m={m!r} is out of range: must be a finite number > 0")
        if adaptive and not 1 <= w <= w_max:
            raise ValueError(f"w={w!r} is out of range: with adaptive=True it must lie in [1, w_max={w_max}]")
        if adaptive and not m_min <= m <= 1:
            raise ValueError(f"m={m!r} is out of range: with adaptive=True it must lie in [m_min={m_min}, 1]")
        if timing not in STARE_TIMINGS:
            raise ValueError(f"timing={timing!r} is not allowed: choose one of {STARE_TIMINGS}")
        self.target_entropy = float(target_entropy)
        self.adaptive = bool(adaptive)
        self.alpha = float(alpha)
        self.w_max = float(w_max)
        self.m_min = float(m_min)
        self.timing = timing
        self.w = float(w)
        self.m = float(m)
        self.gate_on = False
        self.last_entropy: Optional[float] = None
        self.last_params = StepParams(gate_on=False, w=self.w, m=self.m)
        self.num_updates = 0

    def update(self, entropy: Union[float, Tensor]) -> StepParams:
        value = float(entropy.detach().float().item()) if isinstance(entropy, Tensor) else float(entropy)
        if not math.isfinite(value):
            warnings.warn(
                f"STAREController.update got a non-finite entropy ({value}); keeping the previous state",
                RuntimeWarning,
                stacklevel=2,
            )
            return StepParams(self.last_params.gate_on, self.last_params.w, self.last_params.m)
        gate_on = value < self.target_entropy
        before = (self.w, self.m)
        if self.adaptive:
            direction = float((self.target_entropy > value) - (self.target_entropy < value))
            self.w = min(max(self.w + self.alpha * direction, 1.0), self.w_max)
            self.m = min(max(self.m - self.alpha * direction, self.m_min), 1.0)
        use_w, use_m = before if self.timing == "next_step" else (self.w, self.m)
        self.gate_on = gate_on
        self.last_entropy = value
        self.last_params = StepParams(gate_on=gate_on, w=use_w, m=use_m)
        self.num_updates += 1
        return StepParams(gate_on, use_w, use_m)

    def state_dict(self) -> Dict[str, object]:
        return {
            "gate_on": self.gate_on,
            "w": self.w,
            "m": self.m,
            "last_entropy": self.last_entropy,
            "last_params": {"gate_on": self.last_params.gate_on, "w": self.last_params.w, "m": self.last_params.m},
            "num_updates": self.num_updates,
        }

    def load_state_dict(self, state: Dict[str, object]) -> None:
        missing = {"gate_on", "w", "m", "last_entropy", "last_params", "num_updates"} - set(state)
        if missing:
            raise ValueError(f"STAREController state is missing keys {sorted(missing)}")
        self.gate_on = bool(state["gate_on"])
        self.w = float(state["w"])
        self.m = float(state["m"])
        last = state["last_entropy"]
        self.last_entropy = None if last is None else float(last)
        lp = state["last_params"]
        self.last_params = StepParams(gate_on=bool(lp["gate_on"]), w=float(lp["w"]), m=float(lp["m"]))
        self.num_updates = int(state["num_updates"])
