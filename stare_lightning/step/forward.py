"""The policy's forward over one micro-batch, as padded rows or packed into one sequence, with or without logits.

``ForwardLayout`` says how a micro-batch of ``RolloutBatch`` rows reaches the model; every layout returns the
same ``[rows, response_width]`` statistics (within float rounding), so nothing downstream changes:

- padded (the default): ``[rows, prompt_width + response_width]`` with an attention mask; the padding is
  computed and thrown away.
- ``packed``: the rows' real tokens laid end to end in one ``[1, tokens]`` sequence, positions restarting at 0
  for each row, no attention mask. Hugging Face models read such position ids as packed sequences and attend
  only within each row (a block-diagonal causal mask; varlen kernels under FlashAttention). Only the logits
  that score response tokens are computed (``logits_to_keep`` with their indices), then scattered back to rows.
- ``share_prompts`` (with ``packed``): rows with the same prompt (the samples of one group) share one copy of
  it: the prompt is laid out once, each response after it attends to it and to its own earlier tokens only (an
  explicit mask), at the positions it has in its own row. Every response token sees exactly what it sees in its
  row, so the statistics are the same; the prompt's forward and backward run once instead of once per sample.
- ``fused_head``: the decoder's last hidden states go straight into ``token_stats_from_hidden``, which forms
  the logits a chunk of positions at a time with the LM head's weight and recomputes them in the backward, so
  no ``[tokens, vocab]`` tensor is ever held. Needs an LM head that is a plain bias-free linear layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from stare_lightning.algorithms import TokenStats, token_stats_from_hidden, token_stats_from_logits
from stare_lightning.models.lora import base_model
from stare_lightning.step.batch import RolloutBatch


@dataclass(frozen=True)
class ForwardLayout:
    packed: bool = False
    fused_head: bool = False
    share_prompts: bool = False


PADDED = ForwardLayout()


@dataclass(frozen=True)
class PackedRows:
    """A micro-batch's real tokens as one sequence, and where its response tokens sit in it."""

    input_ids: Tensor  # [1, tokens]
    position_ids: Tensor  # [1, tokens]: each token's position in its own row
    scoring_index: Tensor  # [scored], the packed index of the logit that scores each present response token
    present: Tensor  # [rows, response_width] bool: response columns that hold a token (tool replies included)
    # [1, 1, tokens, tokens] bool (True: attend) when prompts are shared; None: the model reads the rows from
    # the restarting positions (a block-diagonal causal mask).
    attention_mask: Tensor | None = None

    @classmethod
    def of(cls, batch: RolloutBatch, *, share_prompts: bool = False) -> PackedRows:
        real = batch.attention_mask.bool()
        present = real[:, batch.prompt_width :]
        owners = _prompt_owners(batch) if share_prompts else list(range(batch.num_rows))
        if owners == list(range(batch.num_rows)):  # every row keeps its own prompt: plain packing
            packed_index = real.flatten().long().cumsum(0).view_as(real) - 1  # each real token's packed index
            # The logit at packed position i scores the token at i + 1; a response never starts a row (prompts
            # are non-empty), so the scoring position always lies in the same row.
            return cls(
                input_ids=batch.input_ids[real].unsqueeze(0),
                position_ids=batch.position_ids()[real].unsqueeze(0),
                scoring_index=packed_index[:, batch.prompt_width :][present] - 1,
                present=present,
            )
        return cls._sharing(batch, real, present, owners)

    @classmethod
    def _sharing(cls, batch: RolloutBatch, real: Tensor, present: Tensor, owners: list[int]) -> PackedRows:
        """Each distinct prompt once, then the responses of every row that owns or shares it."""
        positions = batch.position_ids()
        ids, pos, group, branch, scoring = [], [], [], [], []
        last_prompt_index: dict[int, int] = {}  # owner row -> packed index of its prompt's last token
        length = 0
        for row, owner in enumerate(owners):
            if owner == row:
                prompt = real[row, : batch.prompt_width]
                ids.append(batch.input_ids[row, : batch.prompt_width][prompt])
                pos.append(positions[row, : batch.prompt_width][prompt])
                count = int(prompt.sum())
                group.append(torch.full((count,), owner))
                branch.append(torch.full((count,), -1))  # the prompt: seen by every response of its group
                length += count
                last_prompt_index[owner] = length - 1
            response = present[row]
            count = int(response.sum())
            ids.append(batch.response_ids[row][response])
            pos.append(positions[row, batch.prompt_width :][response])
            group.append(torch.full((count,), owner))
            branch.append(torch.full((count,), row))
            # Token 0 is scored by the prompt's last token, token t > 0 by token t - 1 of this response.
            scoring.append(torch.cat([torch.tensor([last_prompt_index[owner]]), length + torch.arange(count)])[:count])
            length += count
        group, branch = torch.cat(group), torch.cat(branch)
        # Query i sees key j when j is not later, in the same group, and either the group's prompt or i's own row.
        mask = (branch[None, :] == -1) | (branch[None, :] == branch[:, None])
        mask &= group[None, :] == group[:, None]
        mask.tril_()
        device = batch.input_ids.device
        return cls(
            input_ids=torch.cat(ids).unsqueeze(0),
            position_ids=torch.cat(pos).unsqueeze(0),
            scoring_index=torch.cat(scoring).to(device),
            present=present,
            attention_mask=mask.to(device)[None, None],
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
    packed = PackedRows.of(batch, share_prompts=layout.share_prompts)
    return packed.to_rows(_packed_logits(model, packed)[0])


def _packed_logits(model: torch.nn.Module, packed: PackedRows) -> Tensor:
    """``[1, scored, vocab]``: only the logits that score response tokens."""
    output = model(**_packed_inputs(model, packed), use_cache=False, logits_to_keep=packed.scoring_index)
    return output.logits


def _packed_inputs(model: torch.nn.Module, packed: PackedRows) -> dict[str, Tensor]:
    inputs = {"input_ids": packed.input_ids, "position_ids": packed.position_ids}
    if packed.attention_mask is not None:
        implementation = getattr(model.config, "_attn_implementation", None)
        if implementation not in ("sdpa", "eager"):
            raise ValueError(
                f"forward.share_prompts=true needs the sdpa or eager attention (an explicit mask); this model uses "
                f"{implementation!r}: set forward.share_prompts=false"
            )
        mask = packed.attention_mask
        if implementation == "eager":  # an additive mask
            mask = torch.zeros(mask.shape, dtype=model.dtype, device=mask.device).masked_fill(
                ~mask, torch.finfo(model.dtype).min
            )
        inputs["attention_mask"] = mask
    return inputs


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
    packed = PackedRows.of(batch, share_prompts=layout.packed and layout.share_prompts)
    targets = batch.response_ids[packed.present].unsqueeze(0)
    if not layout.fused_head:  # statistics of the scored positions only, then back to rows
        return _in_rows(packed, token_stats_from_logits(_packed_logits(model, packed), targets, **options))
    decoder, head = decoder_and_head(model)
    if layout.packed:
        hidden = _decoder_output(model, decoder, _packed_inputs(base_model(model), packed))
        scoring = hidden[0, packed.scoring_index]
    else:
        inputs = dict(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids())
        scoring = _decoder_output(model, decoder, inputs)[:, batch.prompt_width - 1 : -1][packed.present]
    # The head's weight is read after the model's forward: under FSDP2 that forward gathered it (the root's
    # parameters stay gathered until the backward, which reduce-scatters the gradient it gets here).
    return _in_rows(packed, token_stats_from_hidden(scoring.unsqueeze(0), head.weight, targets, **options))


def _decoder_output(model: torch.nn.Module, decoder: torch.nn.Module, inputs: dict[str, Tensor]) -> Tensor:
    """The decoder's last hidden states (after its final norm) from a forward of the whole model that keeps no
    logits (``logits_to_keep`` selects no position). The whole model runs, not the decoder alone, so that an
    FSDP2 root gathers its own parameters (embeddings, final norm, head) as in any forward."""
    captured: list[Tensor] = []
    hook = decoder.register_forward_hook(lambda _module, _args, output: captured.append(output.last_hidden_state))
    nothing = torch.empty(0, dtype=torch.long, device=inputs["input_ids"].device)
    try:
        model(**inputs, use_cache=False, logits_to_keep=nothing)
    finally:
        hook.remove()
    return captured[0]


def _in_rows(packed: PackedRows, stats: TokenStats) -> TokenStats:
    """``[1, scored]`` statistics back at their ``[rows, response_width]`` places."""
    values = {name: getattr(stats, name) for name in TokenStats.__dataclass_fields__}
    return TokenStats(**{name: None if v is None else packed.to_rows(v[0]) for name, v in values.items()})


def _prompt_owners(batch: RolloutBatch) -> list[int]:
    """For each row, the first row of the micro-batch with the same prompt tokens (itself when none earlier)."""
    first: dict[tuple[int, ...], int] = {}
    owners = []
    for row in range(batch.num_rows):
        prompt = batch.input_ids[row, : batch.prompt_width][batch.attention_mask[row, : batch.prompt_width].bool()]
        owners.append(first.setdefault(tuple(prompt.tolist()), row))
    return owners


def decoder_and_head(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Linear]:
    """The decoder stack and the LM head of a Hugging Face causal LM (through a peft wrapper), or a ValueError
    saying why the fused head cannot stand in for this model's own."""
    base = base_model(model)
    name = type(base).__name__
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    decoder = base.get_decoder() if hasattr(base, "get_decoder") else None
    if decoder is None or not isinstance(head, torch.nn.Linear) or head.bias is not None:
        raise ValueError(f"forward.fused_lm_head needs a causal LM with a bias-free linear LM head; {name} has none")
    config = getattr(base, "config", None)
    for scaled in ("final_logit_softcapping", "logit_scale", "logits_scaling"):
        if getattr(config, scaled, None) not in (None, 1.0):
            raise ValueError(
                f"forward.fused_lm_head cannot reproduce {name}'s {scaled}; set forward.fused_lm_head=false"
            )
    return decoder, head
