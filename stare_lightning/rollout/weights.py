"""The policy's weights as a rollout engine loads them: full tensors under checkpoint names, one at a time."""

from __future__ import annotations

from collections.abc import Iterator

import torch

# Wrapper infixes that torch/Lightning put into parameter names; engines expect plain checkpoint names.
_WRAPPER_PREFIXES = ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.", "module.")


def iter_full_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``(checkpoint_name, full_tensor)`` for every parameter, in module order.

    FSDP2 ``DTensor`` parameters are all-gathered one at a time; every rank must run this loop to the end.
    """
    from torch.distributed.tensor import DTensor

    for name, param in model.named_parameters():
        tensor = param.detach()
        if isinstance(tensor, DTensor):
            tensor = tensor.full_tensor()
        yield checkpoint_name(name), tensor


def checkpoint_name(name: str) -> str:
    """Strip the wrapper infixes (torch.compile, activation checkpointing, DDP) from a parameter name."""
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name
