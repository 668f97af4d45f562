"""The chunked pass over the vocabulary behind ``token_stats``: row sources, reusable buffers, and the
forward and gradient of one chunk of rows (float32 math whatever the input dtype; float64 stays float64).

Internal to ``algorithms``: ``token_stats`` wraps these in its autograd functions.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor


class RowSource:
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
            self.flat: Tensor | None = x.view(self.rows, self.width)
        except RuntimeError:
            self.flat = None

    def get(self, start: int, end: int) -> Tensor:
        if self.flat is not None:
            return self.flat[start:end]
        idx = torch.arange(start, end, device=self.x.device)
        return self.x[idx // self.steps, idx % self.steps]


def math_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for half, bfloat16 and float32 inputs; float64 inputs keep float64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


# See the module docstring: -inf logits give finite statistics, and no probability changes.
LOGPROB_FLOOR = -1.0e4


class Workspace:
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


def chunk_forward(z: Tensor, pbuf: Tensor, tgt: Tensor, with_entropy: bool, with_sens: bool):
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
    ent = -_row_dot(p, z)
    if with_sens:
        s2 = _row_dot(p, p)
        p.mul_(p)
        s2l = _row_dot(p, z)
    return lse, lp, ent, s2, s2l


def _row_dot(a: Tensor, b: Tensor) -> Tensor:
    """``(a * b).sum(-1)`` of two [rows, V] tensors as a batched matrix product: no [rows, V] temporary, and on a
    CPU about 3x faster than ``torch.linalg.vecdot`` (which multiplies, then sums) at V = 49152."""
    return torch.bmm(a.unsqueeze(1), b.unsqueeze(2)).view(-1)


def chunk_grad(
    z: Tensor,
    pbuf: Tensor,
    tgt: Tensor,
    lse: Tensor,
    ent: Tensor | None,
    g_lp: Tensor | None,
    g_ent: Tensor | None,
    temperature: float,
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


def forward_chunks(
    load,
    n: int,
    width: int,
    flat_t: Tensor,
    md: torch.dtype,
    dev: torch.device,
    chunk_size: int,
    with_entropy: bool,
    with_sens: bool,
):
    """The forward pass shared by both autograd functions: ``load(workspace, start, end)`` returns a chunk's
    tempered logits in the workspace; per-row results are gathered into full-length vectors."""
    lse = torch.empty(n, dtype=md, device=dev)
    lp = torch.empty(n, dtype=md, device=dev)
    ent = torch.empty(n if with_entropy else 0, dtype=md, device=dev)
    s2 = torch.empty(n if with_sens else 0, dtype=md, device=dev)
    s2l = torch.empty(n if with_sens else 0, dtype=md, device=dev)
    ws = Workspace(min(chunk_size, n), width, md, dev) if n else None
    with torch.no_grad():
        for start in range(0, n, chunk_size):
            end = min(n, start + chunk_size)
            z = load(ws, start, end)
            c_lse, c_lp, c_ent, c_s2, c_s2l = chunk_forward(
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


def backward_chunks(
    ctx,
    src: RowSource,
    flat_t: Tensor,
    lse: Tensor,
    ent: Tensor,
    g_lp: Tensor | None,
    g_ent: Tensor | None,
    weight: Tensor | None = None,
) -> Iterator[tuple[int, int, Tensor, Tensor]]:
    """The backward pass shared by both autograd functions: for each chunk of rows ``[start, end)`` of ``src`` (the
    logits, or with ``weight`` the hidden states under the LM head ``weight``), ``(start, end, rows, grad)``, where
    ``grad`` is the gradient w.r.t. the chunk's raw logits (``chunk_grad``), recomputed from ``rows``; it lives in
    a reused buffer until the next chunk. ``ctx``: the autograd context ``finish_forward`` filled."""
    width = src.width if weight is None else weight.shape[0]
    chunk_size, temperature = ctx.chunk_size, ctx.temperature
    ws = Workspace(min(chunk_size, src.rows), width, lse.dtype, lse.device)
    for start in range(0, src.rows, chunk_size):
        end = min(src.rows, start + chunk_size)
        rows = src.get(start, end)
        z = ws.load(rows, temperature) if weight is None else ws.load_matmul(rows, weight, temperature)
        grad = chunk_grad(
            z,
            ws.p[: end - start],
            flat_t[start:end],
            lse[start:end],
            ent[start:end] if g_ent is not None else None,
            None if g_lp is None else g_lp[start:end].to(z.dtype),
            None if g_ent is None else g_ent[start:end].to(z.dtype),
            temperature,
        )
        yield start, end, rows, grad


def finish_forward(ctx, temperature: float, chunk_size: int, with_entropy: bool, lp, ent, s2, s2l):
    ctx.temperature = temperature
    ctx.chunk_size = chunk_size
    ctx.with_entropy = with_entropy
    ctx.mark_non_differentiable(s2, s2l)
    if not with_entropy:
        ctx.mark_non_differentiable(ent)
    ctx.set_materialize_grads(False)
    return lp, ent, s2, s2l
