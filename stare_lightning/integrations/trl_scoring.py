"""The scoring pass of ``STAREGRPOTrainer``: each completion token's log-prob, entropy and the two sums behind its
entropy sensitivity Phi, under the policy as TRL's loss forward sees it, and never the ``[rows, T, vocab]`` logits.

How: the decoder runs once per micro-batch of rows (``per_device_train_batch_size``, as TRL's own no-grad passes),
keeping no logits (``logits_to_keep`` selects no position) while a hook takes its last hidden states; those of the
positions that score completion tokens go through ``token_stats_from_hidden``, which forms the logits a few rows at
a time with the LM head's weight. So the pass holds at most the hidden states ``[rows, T, hidden]`` and a few
``[chunk, vocab]`` buffers (about 64 MiB each), as TRL's fused head does.

Like TRL's loss forward: the model runs under the trainer's autocast, and the head's matmul runs in the dtype TRL's
fused head uses (float32 with ``cast_lm_head_to_fp32``; else the autocast dtype when autocast is on, else the hidden
states'), at the sampling temperature, with no position ids (TRL passes none). Unlike TRL's old log-prob pass, it
runs in eval mode (no dropout, as this project scores) with gradient checkpointing off (a no-grad pass keeps
nothing for a backward).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from stare_lightning.algorithms.token_stats import TokenStats, token_stats_from_hidden

__all__ = ["HEAD_BUFFER_ELEMENTS", "check_plain_head", "head_and_decoder", "score_completions"]

# Elements of one [chunk, vocab] float32 buffer of the head pass (64 MiB): the chunk's rows follow the vocabulary.
HEAD_BUFFER_ELEMENTS = 1 << 24
# Model settings that scale or cap the logits after the head: TRL's fused head applies them, this pass does not.
_SCALED_LOGITS = ("final_logit_softcapping", "logit_scale", "output_multiplier", "lm_head_multiplier", "logits_scaling")


def _base(model: torch.nn.Module) -> torch.nn.Module:
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def check_plain_head(model: torch.nn.Module) -> None:
    """Refuse a model whose logits this pass cannot form as TRL's fused head does (a head that is not a bias-free
    linear layer, or logits scaled or capped after it)."""
    base = _base(model)
    name = type(base).__name__
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    decoder = base.get_decoder() if hasattr(base, "get_decoder") else None
    if decoder is None or not isinstance(head, torch.nn.Linear) or head.bias is not None:
        raise ValueError(
            f"STAREGRPOTrainer needs a causal LM with a decoder and a bias-free linear LM head; {name} has none"
        )
    config = base.config.get_text_config() if hasattr(base.config, "get_text_config") else base.config
    for scaled in _SCALED_LOGITS:
        if getattr(config, scaled, None) not in (None, 1.0):
            raise ValueError(
                f"STAREGRPOTrainer cannot score {name}: its config sets {scaled}={getattr(config, scaled)!r}, which "
                "scales the logits after the head, and STARE's scoring pass forms the logits from the head alone"
            )


def head_and_decoder(model: torch.nn.Module) -> tuple[torch.nn.Linear, torch.nn.Module]:
    base = _base(model)
    return base.get_output_embeddings(), base.get_decoder()


def _last_hidden(model, decoder, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
    """The decoder's last hidden states (after its final norm), from a forward of the whole model that keeps no
    logits: the whole model runs, so that a wrapper's hooks run as in any forward."""
    captured: list[Tensor] = []
    hook = decoder.register_forward_hook(lambda _module, _args, output: captured.append(output.last_hidden_state))
    nothing = torch.empty(0, dtype=torch.long, device=input_ids.device)
    try:
        model(input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=nothing, use_cache=False)
    finally:
        hook.remove()
    return captured[0]


def _full(weight: Tensor) -> Tensor:
    """The head's whole weight: FSDP2 holds it as a sharded DTensor after the forward (every process gathers it
    here, as TRL's fused head does)."""
    return weight.full_tensor() if isinstance(weight, DTensor) else weight


@torch.no_grad()
def score_completions(
    model: torch.nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    width: int,
    *,
    rows_per_forward: int,
    temperature: float,
    autocast,
    head_in_fp32: bool,
) -> TokenStats:
    """Statistics ``[rows, width]`` (log-probs, entropy, sum p^2, sum p^2 log p; float32) of the last ``width``
    tokens of ``input_ids`` (the completions). ``autocast``: a callable giving the trainer's autocast context;
    ``head_in_fp32``: TRL's ``cast_lm_head_to_fp32``. The model is put in eval mode for the pass and back after."""
    head, decoder = head_and_decoder(model)
    vocab = head.weight.shape[0]
    chunk = max(1, HEAD_BUFFER_ELEMENTS // vocab)
    was_training = model.training
    model.eval()
    parts = []
    try:
        for start in range(0, input_ids.size(0), rows_per_forward):
            rows = slice(start, start + rows_per_forward)
            with autocast():
                hidden = _last_hidden(model, decoder, input_ids[rows], attention_mask[rows])[:, -width - 1 : -1]
                device = hidden.device.type
                autocast_dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
            dtype = torch.float32 if head_in_fp32 else (autocast_dtype or hidden.dtype)
            weight = _full(head.weight).to(hidden.device, dtype)
            with torch.autocast(hidden.device.type, enabled=False):
                stats = token_stats_from_hidden(
                    hidden.to(dtype),
                    weight,
                    input_ids[rows, -width:],
                    temperature=temperature,
                    chunk_size=chunk,
                    with_sensitivity=True,
                )
            parts.append(stats)
    finally:
        model.train(was_training)
    joined = {name: torch.cat([getattr(p, name) for p in parts]) for name in ("logprobs", "entropy", "sum_p2")}
    return TokenStats(**joined, sum_p2_logp=torch.cat([p.sum_p2_logp for p in parts]))
