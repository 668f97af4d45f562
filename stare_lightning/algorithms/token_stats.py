"""Per-token log-probabilities, entropy and sensitivity sums, computed a chunk of rows at a time.

What it implements: the one pass over the vocabulary that STARE (Luo et al. 2026, arXiv 2606.19236)
needs at every response position: the log-probability of the sampled token, the full-vocabulary
entropy H, and the two sums sum_j pi_j^2 and sum_j pi_j^2 log pi_j from which the entropy
sensitivity Phi is built (see `sensitivity.py`).

How: the B*T positions are treated as rows and processed `chunk_size` rows at a time, in float32
whatever the dtype of the logits (float64 input keeps float64, which makes gradcheck possible),
after dividing the logits by the sampling temperature. A custom autograd function keeps only its
inputs and two numbers per row (log-partition and entropy) and recomputes each chunk's softmax in
the backward, so the extra memory is two reusable [chunk_size, V] buffers plus a temporary of the
same size, never [B*T, V], with or without autograd. `token_stats_from_hidden` goes one step further
and never holds the logits at all: each chunk's logits come from a matmul with the LM head.

Gradients reach the logits (or the hidden states and the LM head) through the log-probabilities and,
when asked for, the entropy. The two sensitivity sums are telemetry and are returned detached.

Departure from the paper: none in substance. The paper's reference code materialises the full
[B, T, V] tensor for the entropy; the chunked pass returns the same numbers within float32 rounding.
Log-probabilities are floored at -1e4 (LOGPROB_FLOOR), so -inf logits (a masked vocabulary) give
finite statistics instead of NaN; no probability changes, since exp(-1e4) is 0 in float32 and float64.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

__all__ = ["TokenStats", "token_stats_from_logits", "token_stats_from_hidden"]


@dataclass
class TokenStats:
    """Per-position statistics, each [B, T] float32.

    `logprobs` is log pi(target); `entropy` is -sum_j pi_j log pi_j; `sum_p2` is sum_j pi_j^2 and
    `sum_p2_logp` is sum_j pi_j^2 log pi_j (both detached). Fields not asked for are None.
    """

    logprobs: Tensor
    entropy: Optional[Tensor] = None
    sum_p2: Optional[Tensor] = None
    sum_p2_logp: Optional[Tensor] = None


def _check_common(temperature: float, chunk_size: int) -> None:
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise ValueError(f"temperature={temperature!r} is not allowed: must be a finite number > 0")
    if not (math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature={temperature!r} is out of range: must be a finite number > 0")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size!r} is out of range: must be an integer >= 1")


def _check_targets(targets: Tensor, batch_shape: torch.Size, vocab: int) -> None:
    if targets.shape != batch_shape:
        raise ValueError(f"targets has shape {tuple(targets.shape)}; expected {tuple(batch_shape)}")
    if targets.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8):
        raise ValueError(f"targets has dtype {targets.dtype}; expected an integer dtype")
    if targets.numel() > 0:
        lo, hi = int(targets.min()), int(targets.max())
        if lo < 0 or hi >= vocab:
            raise ValueError(
                f"targets holds ids in [{lo}, {hi}]; allowed are ids in [0, {vocab - 1}] "
                "(replace padding ids by any valid id and mask those positions)"
            )


class _RowSource:
    """Reads rows [start, end) of a [B, T, X] tensor as a [rows, X] tensor without copying the rest.

    A contiguous-enough tensor is viewed as [B*T, X] and sliced; anything else (e.g. logits[:, :-1])
    is gathered a chunk at a time by advanced indexing, which copies only that chunk.
    """

    def __init__(self, x: Tensor):
        self.x = x
        self.rows = x.shape[0] * x.shape[1]
        self.width = x.shape[2]
        self.steps = x.shape[1]
        try:
            self.flat: Optional[Tensor] = x.view(self.rows, self.width)
        except RuntimeError:
            self.flat = None

    def get(self, start: int, end: int) -> Tensor:
        if self.flat is not None:
            return self.flat[start:end]
        idx = torch.arange(start, end, device=self.x.device)
        return self.x[idx // self.steps, idx % self.steps]


def _math_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for half, bfloat16 and float32 inputs; float64 inputs keep float64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


# See the module docstring: -inf logits give finite statistics, and no probability changes.
LOGPROB_FLOOR = -1.0e4


class _Workspace:
    """Two reusable [chunk, V] buffers in the math dtype (fewer allocations and page faults per chunk)."""

    def __init__(self, rows: int, width: int, dtype: torch.dtype, device: torch.device):
        self.z = torch.empty(rows, width, dtype=dtype, device=device)
        self.p = torch.empty(rows, width, dtype=dtype, device=device)

    def load(self, chunk: Tensor, temperature: float) -> Tensor:
        """The chunk copied into the first buffer in the math dtype and divided by the temperature."""
        z = self.z[: chunk.shape[0]]
        z.copy_(chunk)
        if temperature != 1.0:
            z.div_(temperature)
        return z

    def load_matmul(self, h: Tensor, weight: Tensor, temperature: float) -> Tensor:
        """The chunk's logits h @ weight.T (computed in the weight's dtype) in the first buffer, tempered."""
        z = self.z[: h.shape[0]]
        if weight.dtype == z.dtype:
            torch.mm(h, weight.t(), out=z)
        else:
            z.copy_(h @ weight.t())
        if temperature != 1.0:
            z.div_(temperature)
        return z


def _chunk_forward(z: Tensor, pbuf: Tensor, tgt: Tensor, with_entropy: bool, with_sens: bool):
    """Statistics of one chunk from its tempered logits `z` (overwritten); `pbuf` is scratch of z's shape."""
    mx = z.amax(dim=-1, keepdim=True)
    mx = torch.where(torch.isfinite(mx), mx, torch.zeros((), dtype=mx.dtype, device=mx.device))
    z.sub_(mx)
    p = torch.exp(z, out=pbuf)
    total = p.sum(dim=-1, keepdim=True)
    log_total = total.log()
    lse = (mx + log_total).squeeze(1)
    ent = s2 = s2l = None
    if not (with_entropy or with_sens):
        lp = (z.gather(1, tgt.unsqueeze(1)) - log_total).squeeze(1).clamp_(min=LOGPROB_FLOOR)
        return lse, lp, ent, s2, s2l
    z.sub_(log_total).clamp_(min=LOGPROB_FLOOR)  # z now holds log pi
    lp = z.gather(1, tgt.unsqueeze(1)).squeeze(1)
    p.div_(total)
    ent = -torch.linalg.vecdot(p, z)
    if with_sens:
        s2 = torch.linalg.vecdot(p, p)
        p.mul_(p)
        s2l = torch.linalg.vecdot(p, z)
    return lse, lp, ent, s2, s2l


def _chunk_grad(
    z: Tensor, pbuf: Tensor, tgt: Tensor, lse: Tensor, ent: Optional[Tensor], g_lp: Optional[Tensor],
    g_ent: Optional[Tensor], temperature: float,
) -> Tensor:
    """Gradient of sum(g_lp * logprob + g_ent * entropy) w.r.t. the raw (un-tempered) logits of a chunk.

    With q = log pi and d logpi_o / dz_j = [j = o] - pi_j and dH / dz_j = -pi_j (q_j + H):
    grad_j = g_lp [j = o] - pi_j (g_lp + g_ent * H + g_ent * q_j), then divided by the temperature.
    `z` holds the chunk's tempered logits and is overwritten by the gradient, which is returned.
    """
    z.sub_(lse.unsqueeze(1)).clamp_(min=LOGPROB_FLOOR)  # log pi, exactly as in the forward
    p = torch.exp(z, out=pbuf)
    if g_ent is not None:
        coef = g_ent * ent
        if g_lp is not None:
            coef = coef + g_lp
        z.mul_(g_ent.unsqueeze(1)).add_(coef.unsqueeze(1)).mul_(p).neg_()
        grad = z
    else:
        grad = p.mul_(-g_lp.unsqueeze(1))
    if g_lp is not None:
        rows = torch.arange(grad.shape[0], device=grad.device)
        grad[rows, tgt] += g_lp
    if temperature != 1.0:
        grad.div_(temperature)
    return grad


def _forward_chunks(load, n: int, width: int, flat_t: Tensor, md: torch.dtype, dev: torch.device, chunk_size: int,
                    with_entropy: bool, with_sens: bool):
    """The forward pass shared by both autograd functions: ``load(workspace, start, end)`` returns a chunk's
    tempered logits in the workspace; per-row results are gathered into full-length vectors."""
    lse = torch.empty(n, dtype=md, device=dev)
    lp = torch.empty(n, dtype=md, device=dev)
    ent = torch.empty(n if with_entropy else 0, dtype=md, device=dev)
    s2 = torch.empty(n if with_sens else 0, dtype=md, device=dev)
    s2l = torch.empty(n if with_sens else 0, dtype=md, device=dev)
    ws = _Workspace(min(chunk_size, n), width, md, dev) if n else None
    with torch.no_grad():
        for start in range(0, n, chunk_size):
            end = min(n, start + chunk_size)
            z = load(ws, start, end)
            c_lse, c_lp, c_ent, c_s2, c_s2l = _chunk_forward(
                z, ws.p[: end - start], flat_t[start:end], with_entropy, with_sens
            )
            lse[start:end] = c_lse
            lp[start:end] = c_lp
            if with_entropy:
                ent[start:end] = c_ent
            if with_sens:
                s2[start:end] = c_s2
                s2l[start:end] = c_s2l
    return lse, lp, ent, s2, s2l


def _finish_forward(ctx, temperature: float, chunk_size: int, with_entropy: bool, lp, ent, s2, s2l):
    ctx.temperature = temperature
    ctx.chunk_size = chunk_size
    ctx.with_entropy = with_entropy
    ctx.mark_non_differentiable(s2, s2l)
    if not with_entropy:
        ctx.mark_non_differentiable(ent)
    ctx.set_materialize_grads(False)
    return lp, ent, s2, s2l


class _ChunkedLogitStats(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: Tensor, targets: Tensor, temperature: float, chunk_size: int,
                with_entropy: bool, with_sens: bool):
        src = _RowSource(logits)
        flat_t = targets.reshape(src.rows).long()
        lse, lp, ent, s2, s2l = _forward_chunks(
            lambda ws, start, end: ws.load(src.get(start, end), temperature),
            src.rows, src.width, flat_t, _math_dtype(logits.dtype), logits.device, chunk_size, with_entropy, with_sens,
        )
        ctx.save_for_backward(logits, flat_t, lse, ent)
        return _finish_forward(ctx, temperature, chunk_size, with_entropy, lp, ent, s2, s2l)

    @staticmethod
    @once_differentiable
    def backward(ctx, g_lp, g_ent, _g_s2, _g_s2l):
        logits, flat_t, lse, ent = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None, None, None, None, None
        if not ctx.with_entropy:
            g_ent = None
        if g_lp is None and g_ent is None:
            return torch.zeros_like(logits), None, None, None, None, None
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        src = _RowSource(logits)
        grad_flat = grad.view(src.rows, src.width)
        ws = _Workspace(min(ctx.chunk_size, src.rows), src.width, lse.dtype, lse.device)
        for start in range(0, src.rows, ctx.chunk_size):
            end = min(src.rows, start + ctx.chunk_size)
            z = ws.load(src.get(start, end), ctx.temperature)
            g = _chunk_grad(
                z, ws.p[: end - start], flat_t[start:end], lse[start:end],
                ent[start:end] if g_ent is not None else None,
                None if g_lp is None else g_lp[start:end].to(z.dtype),
                None if g_ent is None else g_ent[start:end].to(z.dtype), ctx.temperature,
            )
            grad_flat[start:end] = g
        return grad, None, None, None, None, None


class _ChunkedHiddenStats(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float, chunk_size: int,
                with_entropy: bool, with_sens: bool):
        src = _RowSource(hidden)
        flat_t = targets.reshape(src.rows).long()
        lse, lp, ent, s2, s2l = _forward_chunks(
            lambda ws, start, end: ws.load_matmul(src.get(start, end), weight, temperature),
            src.rows, weight.shape[0], flat_t, _math_dtype(hidden.dtype), hidden.device, chunk_size, with_entropy,
            with_sens,
        )
        ctx.save_for_backward(hidden, weight, flat_t, lse, ent)
        return _finish_forward(ctx, temperature, chunk_size, with_entropy, lp, ent, s2, s2l)

    @staticmethod
    @once_differentiable
    def backward(ctx, g_lp, g_ent, _g_s2, _g_s2l):
        hidden, weight, flat_t, lse, ent = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if not ctx.with_entropy:
            g_ent = None
        grad_h = torch.zeros(hidden.shape, dtype=hidden.dtype, device=hidden.device) if need_h else None
        # The LM-head gradient is summed over chunks in float32, then cast once to the weight's dtype.
        grad_w = torch.zeros(weight.shape, dtype=_math_dtype(weight.dtype), device=weight.device) if need_w else None
        if (g_lp is None and g_ent is None) or not (need_h or need_w):
            return grad_h, None if grad_w is None else grad_w.to(weight.dtype), None, None, None, None, None
        src = _RowSource(hidden)
        grad_h_flat = grad_h.view(src.rows, src.width) if need_h else None
        ws = _Workspace(min(ctx.chunk_size, src.rows), weight.shape[0], lse.dtype, lse.device)
        for start in range(0, src.rows, ctx.chunk_size):
            end = min(src.rows, start + ctx.chunk_size)
            h = src.get(start, end)
            z = ws.load_matmul(h, weight, ctx.temperature)
            g = _chunk_grad(
                z, ws.p[: end - start], flat_t[start:end], lse[start:end],
                ent[start:end] if g_ent is not None else None,
                None if g_lp is None else g_lp[start:end].to(z.dtype),
                None if g_ent is None else g_ent[start:end].to(z.dtype), ctx.temperature,
            )
            if need_h:
                grad_h_flat[start:end] = g.to(weight.dtype) @ weight
            if need_w:
                if weight.dtype == grad_w.dtype:
                    grad_w.addmm_(g.t(), h)
                else:
                    grad_w.add_(g.to(weight.dtype).t() @ h)
        return grad_h, None if grad_w is None else grad_w.to(weight.dtype), None, None, None, None, None


def _pack(lp: Tensor, ent: Tensor, s2: Tensor, s2l: Tensor, shape, with_entropy: bool, with_sens: bool) -> TokenStats:
    return TokenStats(
        logprobs=lp.view(shape),
        entropy=ent.view(shape) if with_entropy else None,
        sum_p2=s2.view(shape) if with_sens else None,
        sum_p2_logp=s2l.view(shape) if with_sens else None,
    )


def token_stats_from_logits(
    logits: Tensor,
    targets: Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    with_entropy: bool = True,
    with_sensitivity: bool = False,
) -> TokenStats:
    """Statistics of softmax(logits / temperature) at each of the B*T positions.

    logits: [B, T, V], any float dtype, any strides (non-viewable layouts are read a chunk at a time).
    targets: [B, T] integer ids in [0, V); padding positions must hold some valid id.
    Returns float32 [B, T] tensors. Gradients flow to `logits` through `logprobs` and `entropy`;
    the gradient has the logits' dtype. Extra memory, forward and backward: a few
    float32 [chunk_size, V] buffers.
    """
    _check_common(temperature, chunk_size)
    if logits.dim() != 3:
        raise ValueError(f"logits has shape {tuple(logits.shape)}; expected [B, T, V]")
    if not logits.is_floating_point():
        raise ValueError(f"logits has dtype {logits.dtype}; expected a floating dtype")
    _check_targets(targets, logits.shape[:2], logits.shape[2])
    lp, ent, s2, s2l = _ChunkedLogitStats.apply(
        logits, targets, float(temperature), chunk_size, bool(with_entropy), bool(with_sensitivity)
    )
    return _pack(lp, ent, s2, s2l, targets.shape, with_entropy, with_sensitivity)


def token_stats_from_hidden(
    hidden: Tensor,
    lm_head_weight: Tensor,
    targets: Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    with_entropy: bool = True,
    with_sensitivity: bool = False,
) -> TokenStats:
    """Like `token_stats_from_logits(hidden @ lm_head_weight.T, ...)` without ever holding [B, T, V].

    hidden: [B, T, D]; lm_head_weight: [V, D] with the same dtype (no bias, as in common LM heads).
    Each chunk's logits are computed by a matmul in the weight's dtype (as the model's own head
    would), then the statistics in float32. Gradients flow to `hidden` and `lm_head_weight`; the
    weight's gradient is accumulated over chunks in float32 and cast once at the end.
    """
    _check_common(temperature, chunk_size)
    if hidden.dim() != 3:
        raise ValueError(f"hidden has shape {tuple(hidden.shape)}; expected [B, T, D]")
    if lm_head_weight.dim() != 2 or lm_head_weight.shape[1] != hidden.shape[2]:
        raise ValueError(
            f"lm_head_weight has shape {tuple(lm_head_weight.shape)}; expected [V, {hidden.shape[2]}]"
        )
    if hidden.dtype != lm_head_weight.dtype:
        raise ValueError(f"hidden dtype {hidden.dtype} differs from lm_head_weight dtype {lm_head_weight.dtype}")
    _check_targets(targets, hidden.shape[:2], lm_head_weight.shape[0])
    lp, ent, s2, s2l = _ChunkedHiddenStats.apply(
        hidden, lm_head_weight, targets, float(temperature), chunk_size, bool(with_entropy), bool(with_sensitivity)
    )
    return _pack(lp, ent, s2, s2l, targets.shape, with_entropy, with_sensitivity)
