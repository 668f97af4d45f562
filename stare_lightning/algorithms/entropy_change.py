"""The entropy change of an update measured on the same tokens: realised, and to first order in the logit change.

What it implements: a check of the first-order picture of the STARE paper (Luo et al. 2026, section 2) on
real updates, not in the paper. For one position with logits z before and z' after an update, both at the
sampling temperature T (z = logits / T), pi = softmax(z) and H its entropy:

    realised     H(z') - H(z)
    first order  sum_j dH/dz_j (z'_j - z_j),   dH/dz_j = -pi_j (log pi_j + H).

The gradient sums to zero over the vocabulary, so a shift of all logits by a constant changes neither.
The two agree as the step goes to zero; their gap is the second-order part of the change. Positions are
processed in chunks, so the [positions, vocab] temporaries stay bounded.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn.functional import log_softmax

__all__ = ["entropy_change"]


def entropy_change(
    logits_before: Tensor, logits_after: Tensor, *, temperature: float = 1.0, chunk_size: int = 1024
) -> tuple[Tensor, Tensor]:
    """(realised, first order) entropy change per position: ``[..., V]`` logits in, ``[...]`` float32 out."""
    if logits_before.shape != logits_after.shape:
        raise ValueError(f"logits shapes differ: {tuple(logits_before.shape)} vs {tuple(logits_after.shape)}")
    vocab = logits_before.shape[-1]
    before = logits_before.reshape(-1, vocab)
    after = logits_after.reshape(-1, vocab)
    realised, first_order = [], []
    for start in range(0, before.shape[0], chunk_size):
        z = before[start : start + chunk_size].float() / temperature
        z_new = after[start : start + chunk_size].float() / temperature
        log_p = log_softmax(z, dim=-1)
        log_p_new = log_softmax(z_new, dim=-1)
        entropy = -(log_p.exp() * log_p).sum(-1)
        entropy_new = -(log_p_new.exp() * log_p_new).sum(-1)
        grad = -log_p.exp() * (log_p + entropy.unsqueeze(-1))
        realised.append(entropy_new - entropy)
        first_order.append((grad * (z_new - z)).sum(-1))
    shape = logits_before.shape[:-1]
    return torch.cat(realised).reshape(shape), torch.cat(first_order).reshape(shape)
