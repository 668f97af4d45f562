"""``ForwardConfig``: the typed ``forward`` group, how the policy's forwards over a step's rows run."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from stare_lightning.config.checks import flag, number

if TYPE_CHECKING:
    from stare_lightning.step.forward import ForwardLayout


@dataclass
class ForwardConfig:
    micro_batch_tokens: int = 8192
    """Tokens one forward computes: rows x longest row, or packed tokens."""
    logprob_chunk_size: int = 1024
    """Vocabulary rows per chunk of the log-softmax and entropy."""
    # Padding-free micro-batches: each micro-batch's rows packed into one sequence (step/forward.py); the same
    # losses and gradients as the padded layout (tests/test_step_forward.py), without the padding's compute.
    packed_sequences: bool = True
    """Padding-free micro-batches: each micro-batch's rows packed into one sequence."""
    share_prompts: bool = True
    """With packing: the samples of one prompt share one copy of it."""
    fused_lm_head: bool = False
    """Log-probs and entropy from the last hidden states, a chunk at a time: no [tokens, vocab] logits are held (memory
    for long responses; a little more compute)."""

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
        from stare_lightning.step.forward import ForwardLayout  # torch: only when a step is planned

        return ForwardLayout(
            packed=self.packed_sequences, fused_head=self.fused_lm_head, share_prompts=self.share_prompts
        )
