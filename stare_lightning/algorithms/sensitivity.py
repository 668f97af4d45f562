"""Entropy sensitivity Phi of a sampled token and the first-order predicted entropy change.

What it implements: section 2 of the STARE paper (Luo et al. 2026, arXiv 2606.19236). At one
position with logits z, pi = softmax(z), entropy H and sampled token o with surprisal
s = -log pi_o, a policy-gradient step that moves the logits by dz = eta * A * (e_o - pi) changes the
entropy by dH ~= eta * A * Phi, with

    Phi = exp(-s) (s - H) + sum_j pi_j^2 log pi_j + H sum_j pi_j^2.

The three vocabulary reductions come from `token_stats_from_logits(..., with_sensitivity=True)`.

Step-size convention (`predicted_entropy_change`): every valid position's logits are treated as
free parameters (a tabular softmax, no coupling between positions through shared weights) and
the step is gradient ascent of size `step_size` on the SUM over tokens of omega * A * log pi(o):
dz_t = step_size * omega_t * A_t * (e_o - pi_t). The returned value is the change of the
token-mean entropy over the valid tokens, (step_size / N) * sum_t omega_t A_t Phi_t. For SGD with
learning rate lr on a token-mean loss over N tokens, step_size = lr / N; for a real network the
logits move through shared weights and the figure is an idealisation (it ignores the kernel that
couples positions), useful for its sign and its per-quadrant split.

Departure from the paper: none; the paper defines Phi, this module adds the normalised predicted
change that the project logs as `entropy/predicted_delta`.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["entropy_sensitivity", "predicted_entropy_change"]


def entropy_sensitivity(logprobs: Tensor, entropy: Tensor, sum_p2: Tensor, sum_p2_logp: Tensor) -> Tensor:
    """Phi per token, same shape as the inputs (all broadcastable to one shape).

    logprobs: log pi(o); entropy: H; sum_p2: sum_j pi_j^2; sum_p2_logp: sum_j pi_j^2 log pi_j.
    Computed in at least float32. Positive for every token with surprisal >= H.
    """
    dtype = torch.promote_types(logprobs.dtype, torch.float32)
    lp = logprobs.to(dtype)
    ent = entropy.to(dtype)
    s = -lp
    return torch.exp(lp) * (s - ent) + sum_p2_logp.to(dtype) + ent * sum_p2.to(dtype)


def predicted_entropy_change(
    phi: Tensor,
    advantages: Tensor,
    weights: Tensor | None,
    mask: Tensor,
    step_size: float,
    *,
    num_tokens: float | None = None,
) -> Tensor:
    """First-order change of the token-mean entropy for a logit step of size `step_size` (see module doc).

    phi: [B, T]; advantages: [B, T] or [B] (broadcast over T); weights: [B, T] or None (all ones);
    mask: [B, T], nonzero at valid tokens. Returns the scalar
    step_size * sum_valid(omega * A * Phi) / N, where N is `num_tokens` when given (e.g. the global
    count of the optimizer step) and the number of valid tokens here otherwise (0 when there are none).
    """
    if isinstance(step_size, bool) or not isinstance(step_size, (int, float)) or not math.isfinite(step_size):
        raise ValueError(f"step_size={step_size!r} is not allowed: must be a finite number")
    if num_tokens is not None and not (num_tokens > 0):
        raise ValueError(f"num_tokens={num_tokens!r} is out of range: must be > 0 or None")
    if phi.dim() != 2:
        raise ValueError(f"phi has shape {tuple(phi.shape)}; expected [B, T]")
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    valid = mask.to(torch.bool)
    dtype = torch.promote_types(phi.dtype, torch.float32)
    term = phi.to(dtype) * advantages.to(dtype)
    if weights is not None:
        term = term * weights.to(dtype)
    total = torch.where(valid, term, torch.zeros((), dtype=term.dtype, device=term.device)).sum()
    n = valid.sum() if num_tokens is None else torch.tensor(float(num_tokens), device=total.device)
    return step_size * total / n.clamp(min=1)
