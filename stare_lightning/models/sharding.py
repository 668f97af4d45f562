"""FSDP2 sharding of a Hugging Face causal LM: ``fully_shard`` on every decoder layer, then on the root.

Applied in ``configure_model`` under Lightning's ``ModelParallelStrategy``, which provides the device mesh.
Sharding layer by layer lets FSDP2 gather one layer's parameters at a time in forward and backward.
A LoRA policy (peft: ``PeftModel`` -> ``LoraModel`` -> the HF model) is sharded the same way, on the HF model
inside the wrapper: each decoder layer's group then holds its frozen base weights and its adapters together,
the adapters alone get gradients (reduce-scattered) and optimizer state, and the frozen weights are only
sharded and gathered.
``sharding_policies`` reads the strategy's mixed-precision and CPU-offload policies (``FSDP2Strategy``).
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh

from stare_lightning.models.lora import base_model


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated transformer blocks of an HF causal LM (Llama, Qwen2, Mistral, GPT-2 layouts)."""
    for path in ("model.layers", "transformer.h", "model.decoder.layers", "gpt_neox.layers"):
        module = model
        try:
            for name in path.split("."):
                module = getattr(module, name)
        except AttributeError:
            continue
        return list(module)
    raise ValueError(f"cannot find the decoder layers of {type(model).__name__} to shard")


def sharded_root(model: torch.nn.Module) -> torch.nn.Module:
    """The module ``fully_shard`` is applied to last: ``model``, or the HF model inside a peft wrapper.

    Not the wrapper itself: peft's ``generate`` calls the HF model's ``generate``, whose forward passes never
    go through the wrapper's, so a root on the wrapper would leave the embeddings and the LM head sharded there
    (the HF rollout engine generates with the trainer's module). Every forward of the wrapper, training's
    included, runs the HF model's forward, so the root's gathers happen on both paths.
    """
    return base_model(model)


def sharding_policies(strategy) -> dict:
    """``shard_model``'s policies from a strategy: its ``mixed_precision_policy`` and ``offload_policy``
    (None where it has none)."""
    return {
        "mp_policy": getattr(strategy, "mixed_precision_policy", None),
        "offload_policy": getattr(strategy, "offload_policy", None),
    }


def shard_model(model: torch.nn.Module, device_mesh: DeviceMesh, *, mp_policy=None, offload_policy=None) -> None:
    """Shard ``model`` (a LoRA policy too) in place over the mesh's data-parallel dimension; ``mp_policy``:
    FSDP2's ``MixedPrecisionPolicy`` (None keeps forward and backward in the parameters' dtype);
    ``offload_policy``: FSDP2's ``CPUOffloadPolicy`` (None keeps the shards on the device)."""
    from torch.distributed.fsdp import fully_shard

    mesh = (
        device_mesh["data_parallel"]
        if device_mesh.mesh_dim_names and "data_parallel" in device_mesh.mesh_dim_names
        else device_mesh
    )
    kwargs = {"mesh": mesh}
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    if offload_policy is not None:
        kwargs["offload_policy"] = offload_policy
    root = sharded_root(model)
    for layer in decoder_layers(root):
        fully_shard(layer, **kwargs)
    fully_shard(root, **kwargs)
