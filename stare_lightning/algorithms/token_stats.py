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

from dataclasses import dataclass

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from stare_lightning.algorithms.vocab_chunks import (
    RowSource,
    backward_chunks,
    finish_forward,
    forward_chunks,
    math_dtype,
)

__all__ = ["TokenStats", "token_stats_from_logits", "token_stats_from_hidden"]


@dataclass
class TokenStats:
    """Per-position statistics, each [B, T] float32.

    `logprobs` is log pi(target); `entropy` is -sum_j pi_j log pi_j; `sum_p2` is sum_j pi_j^2 and
    `sum_p2_logp` is sum_j pi_j^2 log pi_j (both detached). Fields not asked for are None.
    """

    logprobs: Tensor
    entropy: Tensor | None = None
    sum_p2: Tensor | None = None
    sum_p2_logp: Tensor | None = None


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


class _ChunkedLogitStats(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, logits: Tensor, targets: Tensor, temperature: float, chunk_size: int, with_entropy: bool, with_sens: bool
    ):
        src = RowSource(logits)
        flat_t = targets.reshape(src.rows).long()
        lse, lp, ent, s2, s2l = forward_chunks(
            lambda ws, start, end: ws.load(src.get(start, end), temperature),
            src.rows,
            src.width,
            flat_t,
            math_dtype(logits.dtype),
            logits.device,
            chunk_size,
            with_entropy,
            with_sens,
        )
        ctx.save_for_backward(logits, flat_t, lse, ent)
        return finish_forward(ctx, temperature, chunk_size, with_entropy, lp, ent, s2, s2l)

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
        src = RowSource(logits)
        grad_flat = grad.view(src.rows, src.width)
        for start, end, _, g in backward_chunks(ctx, src, flat_t, lse, ent, g_lp, g_ent):
            grad_flat[start:end] = g
        return grad, None, None, None, None, None


class _ChunkedHiddenStats(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        hidden: Tensor,
        weight: Tensor,
        targets: Tensor,
        temperature: float,
        chunk_size: int,
        with_entropy: bool,
        with_sens: bool,
    ):
        src = RowSource(hidden)
        flat_t = targets.reshape(src.rows).long()
        lse, lp, ent, s2, s2l = forward_chunks(
            lambda ws, start, end: ws.load_matmul(src.get(start, end), weight, temperature),
            src.rows,
            weight.shape[0],
            flat_t,
            math_dtype(hidden.dtype),
            hidden.device,
            chunk_size,
            with_entropy,
            with_sens,
        )
        ctx.save_for_backward(hidden, weight, flat_t, lse, ent)
        return finish_forward(ctx, temperature, chunk_size, with_entropy, lp, ent, s2, s2l)

    @staticmethod
    @once_differentiable
    def backward(ctx, g_lp, g_ent, _g_s2, _g_s2l):
        hidden, weight, flat_t, lse, ent = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if not ctx.with_entropy:
            g_ent = None
        grad_h = torch.zeros(hidden.shape, dtype=hidden.dtype, device=hidden.device) if need_h else None
        # The LM-head gradient is summed over chunks in float32, then cast once to the weight's dtype.
        grad_w = torch.zeros(weight.shape, dtype=math_dtype(weight.dtype), device=weight.device) if need_w else None
        if (g_lp is None and g_ent is None) or not (need_h or need_w):
            return grad_h, None if grad_w is None else grad_w.to(weight.dtype), None, None, None, None, None
        src = RowSource(hidden)
        grad_h_flat = grad_h.view(src.rows, src.width) if need_h else None
        for start, end, h, g in backward_chunks(ctx, src, flat_t, lse, ent, g_lp, g_ent, weight=weight):
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
    if logits.dim() != 3:
        raise ValueError(f"logits has shape {tuple(logits.shape)}; expected [B, T, V]")
    if not logits.is_floating_point():
        raise ValueError(f"logits has dtype {logits.dtype}; expected a floating dtype")
    _check_targets(targets, logits.shape[:2], logits.shape[2])
    lp, ent, s2, s2l = _ChunkedLogitStats.apply(
        logits, targets, float(temperature), chunk_size, bool(with_entropy), bool(with_sensitivity)
    )
    return _pack(lp, ent, s2, s2l, targets.shape, with_entropy, with_sensitivity)


# The same keyword options as token_stats_from_logits on purpose: the two differ only in where the logits come from.
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
    if hidden.dim() != 3:
        raise ValueError(f"hidden has shape {tuple(hidden.shape)}; expected [B, T, D]")
    if lm_head_weight.dim() != 2 or lm_head_weight.shape[1] != hidden.shape[2]:
        raise ValueError(f"lm_head_weight has shape {tuple(lm_head_weight.shape)}; expected [V, {hidden.shape[2]}]")
    if hidden.dtype != lm_head_weight.dtype:
        raise ValueError(f"hidden dtype {hidden.dtype} differs from lm_head_weight dtype {lm_head_weight.dtype}")
    _check_targets(targets, hidden.shape[:2], lm_head_weight.shape[0])
    lp, ent, s2, s2l = _ChunkedHiddenStats.apply(
        hidden, lm_head_weight, targets, float(temperature), chunk_size, bool(with_entropy), bool(with_sensitivity)
    )
    return _pack(lp, ent, s2, s2l, targets.shape, with_entropy, with_sensitivity)
