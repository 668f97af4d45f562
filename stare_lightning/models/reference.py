"""The reference policy a KL penalty measures against.

Full fine-tuning keeps a frozen copy of the starting model (``load_reference``). A LoRA policy needs no copy: its
base weights are frozen, so the policy with its adapters switched off *is* the starting model, and the reference
log-probs come from the same module in a second forward (peft's ``disable_adapter``). That saves a whole model's
memory (and its FSDP2 gathers) for the price of that forward, which the copy costs too.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from stare_lightning.models.lora import is_lora


@dataclass(frozen=True)
class ReferencePolicy:
    """What scores the reference log-probs: ``model`` as it is, or with its LoRA adapters off (``adapters_off``)."""

    model: torch.nn.Module
    adapters_off: bool = False

    @classmethod
    def of(cls, policy: torch.nn.Module, frozen_copy: torch.nn.Module | None) -> ReferencePolicy:
        """A LoRA ``policy``'s own base, else ``frozen_copy`` (which a LoRA policy must not be given: it would be a
        second copy of weights the policy already holds)."""
        if is_lora(policy):
            if frozen_copy is not None:
                raise ValueError("a LoRA policy is its own reference (adapters off); it takes no frozen copy")
            return cls(policy, adapters_off=True)
        if frozen_copy is None:
            raise ValueError("a fully fine-tuned policy needs a frozen copy of its starting weights as reference")
        return cls(frozen_copy)

    @contextmanager
    def scoring(self) -> Iterator[torch.nn.Module]:
        """The module to run the reference forward with, inside this context only. Adapters off, the policy also
        runs in eval mode, as a frozen copy does (no dropout), and goes back to its own mode afterwards."""
        if not self.adapters_off:
            yield self.model
            return
        training = self.model.training
        self.model.eval()
        try:
            with self.model.disable_adapter():
                yield self.model
        finally:
            self.model.train(training)
