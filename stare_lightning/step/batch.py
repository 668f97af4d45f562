"""A step's rollouts as padded tensors, the complete ``Experience`` an update trains on, and the slices of both.

Layout of one row: the prompt left-padded to the step's longest prompt, then the response right-padded
to the step's longest response. Every response therefore starts at the same column, so the logits that
score response token ``t`` sit at column ``prompt_width - 1 + t`` for every row, and a micro-batch only
has to trim the columns its own rows never use. In a tool-using episode the response also holds the tool's
replies: attended like every other token, but outside ``response_mask`` (the tokens the policy sampled), so
nothing that reads the mask (loss, selection, entropy, telemetry, canary) ever sees them.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, fields, replace
from typing import TypeVar

import torch
from torch import Tensor

from stare_lightning.rollout.base import Rollouts

Rows = TypeVar("Rows", bound="RolloutBatch")


@dataclass(frozen=True)
class RolloutBatch:
    """The step's kept rollouts; per-token fields are ``[rows, response_width]``."""

    input_ids: Tensor  # [N, prompt_width + response_width]
    attention_mask: Tensor  # [N, prompt_width + response_width]
    response_mask: Tensor  # [N, response_width], bool: the tokens the policy sampled (not tool replies, not padding)
    prompt_width: int
    rewards: Tensor  # [N]
    advantages: Tensor  # [N]
    rollout_logprobs: Tensor  # [N, response_width], the engine's sampled-token log-probs

    @property
    def num_rows(self) -> int:
        return self.input_ids.shape[0]

    @property
    def response_width(self) -> int:
        return self.response_mask.shape[1]

    @property
    def response_ids(self) -> Tensor:
        return self.input_ids[:, self.prompt_width :]

    def position_ids(self) -> Tensor:
        # Left padding: positions count real tokens only, as in generation.
        return (self.attention_mask.long().cumsum(-1) - 1).clamp(min=0)

    def select(self: Rows, rows: Tensor | slice) -> Rows:
        """The given rows with every column kept (mini-batches)."""
        return replace(self, **{name: value[rows] for name, value in self._tensors().items()})

    def trimmed(self: Rows) -> Rows:
        """Drop the padding columns no row uses (left of the prompts, right of the responses)."""
        prompt_lengths = self.attention_mask[:, : self.prompt_width].sum(-1)
        response_lengths = self.attention_mask[:, self.prompt_width :].sum(-1)  # tool replies included
        left = self.prompt_width - int(prompt_lengths.max().item()) if self.num_rows else 0
        width = max(int(response_lengths.max().item()) if self.num_rows else 0, 1)
        values = {}
        for name, value in self._tensors().items():
            if name in ("input_ids", "attention_mask"):
                value = value[:, left : self.prompt_width + width]
            elif value.dim() == 2:
                value = value[:, :width]
            values[name] = value
        return replace(self, prompt_width=self.prompt_width - left, **values)

    def to(self: Rows, device: torch.device | str) -> Rows:
        return replace(self, **{name: value.to(device) for name, value in self._tensors().items()})

    def _tensors(self) -> dict[str, Tensor]:
        return {f.name: getattr(self, f.name) for f in fields(self) if isinstance(getattr(self, f.name), Tensor)}


@dataclass(frozen=True)
class Experience(RolloutBatch):
    """A rollout batch with every per-token input of the loss, built once before the optimizer steps.

    ``old_logprobs`` None means on-policy without a scoring pass: the first forward's detached log-probs
    stand in. ``stare_weights`` is STARE's omega from a selection over the step's batch (None: no
    step-wide weight applies, e.g. the gate is closed) and ``stare_selected`` that selection's tokens
    (None when the loss selects inside each micro-batch, or without STARE).
    """

    old_logprobs: Tensor | None = None
    phi: Tensor | None = None  # entropy sensitivity of each sampled token (the ``sensitivity`` selector)
    entropy: Tensor | None = None  # the scoring pass's predictive entropy (the ``entropy`` selector)
    stare_weights: Tensor | None = None
    stare_selected: Tensor | None = None  # bool

    @classmethod
    def build(
        cls,
        batch: RolloutBatch,
        *,
        old_logprobs: Tensor | None,
        phi: Tensor | None,
        stare_weights: Tensor | None,
        stare_selected: Tensor | None,
        entropy: Tensor | None = None,
    ) -> Experience:
        rollout_fields = {f.name: getattr(batch, f.name) for f in fields(RolloutBatch)}
        return cls(
            **rollout_fields,
            old_logprobs=old_logprobs,
            phi=phi,
            entropy=entropy,
            stare_weights=stare_weights,
            stare_selected=stare_selected,
        )


def build_rollout_batch(rollouts: Rollouts, rewards: Tensor, advantages: Tensor, *, pad_token_id: int) -> RolloutBatch:
    """Pad ``rollouts`` into a ``RolloutBatch``. ``rewards`` and ``advantages`` are per response row."""
    rows = len(rollouts.response_ids)
    prompt_width = max(len(p) for p in rollouts.prompt_ids)
    response_width = max(max((len(r) for r in rollouts.response_ids), default=1), 1)
    input_ids = torch.full((rows, prompt_width + response_width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    response_mask = torch.zeros(rows, response_width, dtype=torch.bool)
    rollout_logprobs = torch.zeros(rows, response_width)
    for i, (prompt, response, logprobs, sampled) in enumerate(
        zip(rollouts.prompt_ids, rollouts.response_ids, rollouts.response_logprobs, rollouts.policy_masks)
    ):
        start = prompt_width - len(prompt)
        input_ids[i, start:prompt_width] = torch.tensor(prompt, dtype=torch.long)
        attention_mask[i, start : prompt_width + len(response)] = 1
        if response:
            input_ids[i, prompt_width : prompt_width + len(response)] = torch.tensor(response, dtype=torch.long)
            response_mask[i, : len(response)] = torch.tensor(sampled, dtype=torch.bool)
            rollout_logprobs[i, : len(response)] = torch.tensor(logprobs, dtype=torch.float32)
    return RolloutBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        response_mask=response_mask,
        prompt_width=prompt_width,
        rewards=rewards.float(),
        advantages=advantages.float(),
        rollout_logprobs=rollout_logprobs,
    )


def concatenate(batches: list[Rows], *, pad_token_id: int) -> Rows:
    """The rows of ``batches`` in one batch of their type: prompts left-padded and responses right-padded to the
    widest, so the layout above holds. Per-token fields absent (None) in one batch must be absent in all."""
    prompt_width = max(batch.prompt_width for batch in batches)
    response_width = max(batch.response_width for batch in batches)
    widened = []
    for batch in batches:
        left, right = prompt_width - batch.prompt_width, response_width - batch.response_width
        values = {}
        for name, value in batch._tensors().items():
            if name in ("input_ids", "attention_mask"):
                fill = pad_token_id if name == "input_ids" else 0
                value = torch.nn.functional.pad(value, (left, right), value=fill)
            elif value.dim() == 2:
                value = torch.nn.functional.pad(value, (0, right))
            values[name] = value
        widened.append(values)
    names = widened[0].keys()
    if any(values.keys() != names for values in widened):
        raise ValueError("cannot concatenate batches that hold different per-token fields")
    merged = {name: torch.cat([values[name] for values in widened]) for name in names}
    return replace(batches[0], prompt_width=prompt_width, **merged)


def filler_micro_batch(batch: Rows) -> Rows:
    """What a rank runs when the others still have a micro-batch and it has none: its first row, trimmed. A sharded
    policy's forward is a collective, so every rank runs as many; a filler's output is dropped (a no-grad pass) or
    its loss weighted 0 (the update)."""
    return batch.select(slice(0, 1)).trimmed()


def micro_batches(batch: Rows, token_budget: int, *, packed: bool = False) -> Iterator[Rows]:
    """Consecutive rows grouped so that the tokens a forward computes stay within ``token_budget``: rows x
    longest row (in real tokens) when padded, the sum of the rows' real tokens when ``packed`` (padding-free).

    A single row longer than the budget still forms a micro-batch of its own.
    """
    lengths = batch.attention_mask.sum(-1).tolist()
    start = 0
    while start < batch.num_rows:
        end, longest, total = start, 0, 0
        while end < batch.num_rows:
            longest_if_added, total_if_added = max(longest, int(lengths[end])), total + int(lengths[end])
            cost = total_if_added if packed else longest_if_added * (end - start + 1)
            if end > start and cost > token_budget:
                break
            longest, total, end = longest_if_added, total_if_added, end + 1
        yield batch.select(slice(start, end)).trimmed()
        start = end


def mini_batch_rows(
    num_rows: int,
    num_mini_batches: int,
    generator: torch.Generator | None = None,
    *,
    offset: int = 0,
    total_rows: int | None = None,
) -> list[Tensor]:
    """This rank's row indices in each PPO mini-batch.

    The split is made over the global batch of ``total_rows`` rows (default: ``num_rows``), of which this
    rank holds rows ``[offset, offset + num_rows)``: a shuffled split into ``num_mini_batches`` near-equal
    parts, each rank keeping its own rows of every part. With the same ``generator`` seed on every rank this
    gives the mini-batches one process holding the whole batch would use, and the same number of them on
    every rank (so optimizer steps stay collective), even when a part holds none of this rank's rows.
    """
    total = num_rows if total_rows is None else total_rows
    if not 0 <= offset <= offset + num_rows <= total:
        raise ValueError(f"rows [{offset}, {offset + num_rows}) do not lie in a global batch of {total} rows")
    order = torch.randperm(total, generator=generator) if num_mini_batches > 1 else torch.arange(total)
    mine = []
    for part in order.tensor_split(num_mini_batches):
        if part.numel():  # parts are empty on every rank alike (fewer global rows than mini-batches)
            mine.append(part[(part >= offset) & (part < offset + num_rows)] - offset)
    return mine
