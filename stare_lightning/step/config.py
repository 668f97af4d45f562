"""``ForwardConfig``: the typed ``forward`` group, how the policy's forwards over a step's rows run."""

from __future__ import annotations

from dataclasses import dataclass

from stare_lightning.config.checks import flag, number
from stare_lightning.step.forward import ForwardLayout


@dataclass
class ForwardConfig:
    micro_batch_tokens: int = 8192  # the tokens one forward computes (rows x longest row, or packed tokens)
    logprob_chunk_size: int = 1024  # vocabulary rows per chunk of the log-softmax and entropy
    # Padding-free micro-batches: each micro-batch's rows packed into one sequence (step/forward.py); the same
    # losses and gradients as the padded layout (tests/test_step_forward.py), without the padding's compute.
    packed_sequences: bool = True
    # With packed_sequences: the samples of one prompt share one copy of it in the forward and backward.
    share_prompts: bool = True
    # Log-probs and entropy from the last hidden states and the LM head a chunk at a time: no [tokens, vocab]
    # logits are held, in the forward or the backward (memory for long responses; a little more compute).
    fused_lm_head: bool = False

    def __post_init__(self) -> None:
        p = "forward."
        number(f"{p}micro_batch_tokens", self.micro_batch_tokens, low=1, integer=True)
        number(f"{p}logprob_chunk_size", self.logprob_chunk_size, low=1, integer=True)
        flag(f"{p}packed_sequences", self.packed_sequences)
        flag(f"{p}fused_lm_head", self.fused_lm_head)
        flag(f"{p}share_prompts", self.share_prompts)
        if self.share_prompts and not self.packed_sequences:
            raise ValueError(
                f"{p}share_prompts=true does nothing without {p}packed_sequences=true: prompts are shared inside "
                "a packed sequence; set both"
            )

    def layout(self) -> ForwardLayout:
        return ForwardLayout(
            packed=self.packed_sequences, fused_head=self.fused_lm_head, share_prompts=self.share_prompts
        )
