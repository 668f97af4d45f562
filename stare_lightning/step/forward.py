"""The policy's forward over one micro-batch, as padded rows or packed into one sequence, with or without logits.

``ForwardLayout`` says how a micro-batch of ``RolloutBatch`` rows reaches the model; every layout returns the
same ``[rows, response_width]`` statistics (within float rounding), so nothing downstream changes:

- padded (the default): ``[rows, prompt_width + response_width]`` with an attention mask; the padding is
  computed and thrown away.
- ``packed``: the rows' real tokens laid end to end in one ``[1, tokens]`` sequence, positions restarting at 0
  for each row, no attention mask. Hugging Face models read such position ids as packed sequences and attend
  only within each row (a block-diagonal causal mask; varlen kernels under FlashAttention). Only the logits
  that score response tokens are computed (``logits_to_keep`` with their indices), then scattered back to rows.
- ``fused_head``: the decoder's last hidden states go straight into ``token_stats_from_hidden``, which forms
  the logits a chunk of positions at a time with the LM head's weight and recomputes them in the backward, so
  no ``[tokens, vocab]`` tensor is ever held. Needs an LM head that is a plain bias-free linear layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from stare_lightning.algorithms import TokenStats, token_stats_from_hidden, token_stats_from_logits
from stare_lightning.step.batch import RolloutBatch


@dataclass(frozen=True)
class ForwardLayout:
    packed: bool = False
    fused_head: bool = False


PADDED = ForwardLayout()


@dataclass(frozen=True)
class PackedRows:
    """A micro-batch's real tokens as one sequence, and where its response tokens sit in it."""

    input_ids: Tensor  # [1, tokens]
    position_ids: Tensor  # [1, tokens], restarting at 0 for each row
    scoring_index: Tensor  # [scored], the packed index of the logit that scores each present response token
    present: Tensor  # [rows, response_width] bool: response columns that hold a token (tool replies included)

    @classmethod
    def of(cls, batch: RolloutBatch) -> PackedRows:
        real = batch.attention_mask.bool()
        packed_index = real.flatten().long().cumsum(0).view_as(real) - 1  # index of each real token once packed
        present = real[:, batch.prompt_width :]
        # The logit at packed position i scores the token at i + 1; a response never starts a row (prompts are
        # non-empty), so the scoring position always lies in the same row.
        scoring_index = packed_index[:, batch.prompt_width :][present] - 1
        return cls(
            input_ids=batch.input_ids[real].unsqueeze(0),
            position_ids=batch.position_ids()[real].unsqueeze(0),
            scoring_index=scoring_index,
            present=present,
        )

    def to_rows(self, values: Tensor) -> Tensor:
        """``[scored, ...]`` values back at their ``[rows, response_width, ...]`` places, zeros elsewhere
        (differentiable)."""
        shape = (*self.present.shape, *values.shape[1:])
        mask = self.present.view(*self.present.shape, *([1] * (values.dim() - 1))).expand(shape)
        return values.new_zeros(shape).masked_scatter(mask, values)


def micro_batch_logits(model: torch.nn.Module, batch: RolloutBatch, layout: ForwardLayout = PADDED) -> Tensor:
    """``[rows, response_width, vocab]``: the logits that score each response token (zeros where a row has none,
    in the packed layout)."""
    if layout.fused_head:
        raise ValueError("the fused LM head never forms the logits; use response_token_stats with it")
    if not layout.packed:
        output = model(
            input_ids=batch.input_ids,
            attention_mask=batch.attention_mask,
            position_ids=batch.position_ids(),
            use_cache=False,
            logits_to_keep=batch.response_width + 1,
        )
        return output.logits[:, :-1]  # the logit at column c scores the token at column c + 1
    packed = PackedRows.of(batch)
    return packed.to_rows(_packed_logits(model, packed)[0])


def _packed_logits(model: torch.nn.Module, packed: PackedRows) -> Tensor:
    """``[1, scored, vocab]``: only the logits that score response tokens."""
    output = model(
        input_ids=packed.input_ids,
        position_ids=packed.position_ids,
        use_cache=False,
        logits_to_keep=packed.scoring_index,
    )
    return output.logits


def response_token_stats(
    model: torch.nn.Module,
    batch: RolloutBatch,
    layout: ForwardLayout = PADDED,
    *,
    temperature: float,
    chunk_size: int,
    with_entropy: bool = True,
    with_sensitivity: bool = False,
) -> TokenStats:
    """Log-probs of the sampled response tokens (and entropy terms) under ``model``, temperature-scaled,
    ``[rows, response_width]`` each."""
    options = dict(
        temperature=temperature, chunk_size=chunk_size, with_entropy=with_entropy, with_sensitivity=with_sensitivity
    )
    if not layout.packed and not layout.fused_head:
        return token_stats_from_logits(micro_batch_logits(model, batch), batch.response_ids, **options)
    packed = PackedRows.of(batch)
    targets = batch.response_ids[packed.present].unsqueeze(0)
    if not layout.fused_head:  # statistics of the scored positions only, then back to rows
        stats = token_stats_from_logits(_packed_logits(model, packed), targets, **options)
        return TokenStats(**{name: _rows(packed, getattr(stats, name)) for name in TokenStats.__dataclass_fields__})
    decoder, head = decoder_and_head(model)
    if layout.packed:
        hidden = decoder(input_ids=packed.input_ids, position_ids=packed.position_ids, use_cache=False)
        scoring = hidden.last_hidden_state[0, packed.scoring_index]
    else:
        hidden = decoder(
            input_ids=batch.input_ids,
            attention_mask=batch.attention_mask,
            position_ids=batch.position_ids(),
            use_cache=False,
        )
        scoring = hidden.last_hidden_state[:, batch.prompt_width - 1 : -1][packed.present]
    stats = token_stats_from_hidden(scoring.unsqueeze(0), head.weight, targets, **options)
    return TokenStats(**{name: _rows(packed, getattr(stats, name)) for name in TokenStats.__dataclass_fields__})


def _rows(packed: PackedRows, values: Tensor | None) -> Tensor | None:
    return None if values is None else packed.to_rows(values[0])


def decoder_and_head(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Linear]:
    """The decoder stack and the LM head of a Hugging Face causal LM (through a peft wrapper), or a ValueError
    saying why the fused head cannot stand in for this model's own."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    name = type(base).__name__
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    decoder = base.get_decoder() if hasattr(base, "get_decoder") else None
    if decoder is None or not isinstance(head, torch.nn.Linear) or head.bias is not None:
        raise ValueError(f"optim.fused_lm_head needs a causal LM with a bias-free linear LM head; {name} has none")
    config = getattr(base, "config", None)
    for scaled in ("final_logit_softcapping", "logit_scale", "logits_scaling"):
        if getattr(config, scaled, None) not in (None, 1.0):
            raise ValueError(f"optim.fused_lm_head cannot reproduce {name}'s {scaled}; set optim.fused_lm_head=false")
    return decoder, head
