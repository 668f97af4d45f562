"""The policy's weights as a rollout engine loads them: full tensors under checkpoint names, one at a time."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from stare_lightning.models.lora import adapter_scaling, is_lora, merge_adapters

# Wrapper infixes that torch/Lightning put into parameter names; engines expect plain checkpoint names.
_WRAPPER_PREFIXES = ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.", "module.")


def iter_full_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``(checkpoint_name, full_tensor)`` for every parameter, in module order.

    FSDP2 ``DTensor`` parameters are all-gathered one at a time; every rank must run this loop to the end.
    A LoRA (peft) policy gives the base model's names, each adapted weight merged (``models/lora.py``).
    """
    weights = ((checkpoint_name(name), full_tensor(param.detach())) for name, param in model.named_parameters())
    if is_lora(model):
        return merge_adapters(weights, adapter_scaling(model))
    return weights


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor of an FSDP2 ``DTensor`` shard (a collective), any other tensor as it is."""
    from torch.distributed.tensor import DTensor

    if not isinstance(tensor, DTensor):
        return tensor
    if tensor.device.type != tensor.device_mesh.device_type:
        # A CPU-offloaded shard (trainer.strategy.cpu_offload): gather on the mesh's device (NCCL), not on the host.
        tensor = tensor.to(tensor.device_mesh.device_type)
    return tensor.full_tensor()


def checkpoint_name(name: str) -> str:
    """Strip the wrapper infixes (torch.compile, activation checkpointing, DDP) from a parameter name."""
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


class CountedBytes:
    """``(name, tensor)`` pairs passed on as they are, counting their bytes (``bytes``: what a weight sync moved)."""

    def __init__(self, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
        self._weights, self.bytes = weights, 0

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in self._weights:
            self.bytes += tensor.numel() * tensor.element_size()
            yield name, tensor


class NonFiniteWeights(ValueError):
    """A weight the trainer was about to hand a rollout engine holds NaN or inf: nothing is pushed. A ``ValueError``:
    the run ends with this one line (``user_errors``), before the step's checkpoint is written."""


def finite_weights(weights: Iterator[tuple[str, torch.Tensor]], policy: str) -> Iterator[tuple[str, torch.Tensor]]:
    """``weights`` as they are, raising ``NonFiniteWeights`` at the first tensor that holds NaN or inf. Every rank
    sees the same full tensors, so every rank raises at the same one and none is left inside a collective.
    ``policy`` says which weights these are in the message (e.g. "the policy after step 3")."""
    for name, tensor in weights:
        if tensor.is_floating_point():
            finite = torch.isfinite(tensor)
            if not bool(finite.all()):
                bad = int(finite.numel() - finite.sum())
                raise NonFiniteWeights(
                    f"weight {name!r} of {policy} holds {bad} non-finite values (NaN or inf) of {tensor.numel()}: it "
                    "was not pushed, the rollout servers keep their previous weights and the checkpoints written so "
                    "far are intact; the update diverged (lower the learning rate, clip gradients, or check the "
                    "loss and rewards for overflow)"
                )
        yield name, tensor
