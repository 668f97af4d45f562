"""The policy's per-token statistics on the response positions of a (micro-)batch."""

from __future__ import annotations

import torch

from stare_lightning.algorithms import TokenStats, token_stats_from_logits
from stare_lightning.experience import Experience


def response_token_stats(
    model: torch.nn.Module,
    batch: Experience,
    *,
    temperature: float,
    chunk_size: int,
    with_entropy: bool = True,
    with_sensitivity: bool = False,
) -> TokenStats:
    """Log-probs of the sampled response tokens (and entropy terms) under ``model``, temperature-scaled.

    Only the logits that score response tokens are kept (``logits_to_keep``), which saves the
    ``[rows, prompt_width, vocab]`` block a plain forward would return.
    """
    width = batch.response_width
    output = model(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        position_ids=batch.position_ids(),
        use_cache=False,
        logits_to_keep=width + 1,
    )
    logits = output.logits[:, :-1]  # the logit at column c scores the token at column c + 1
    return token_stats_from_logits(
        logits,
        batch.response_ids,
        temperature=temperature,
        chunk_size=chunk_size,
        with_entropy=with_entropy,
        with_sensitivity=with_sensitivity,
    )
