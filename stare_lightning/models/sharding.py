"""FSDP2 sharding of a Hugging Face causal LM: ``fully_shard`` on every decoder layer, then on the root.

Applied in ``configure_model`` under Lightning's ``ModelParallelStrategy``, which provides the device mesh.
Sharding layer by layer lets FSDP2 gather one layer's parameters at a time in forward and backward.
``sharding_policies`` reads the strategy's mixed-precision and CPU-offload policies (``FSDP2Strategy``).
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh


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


def sharding_policies(strategy) -> dict:
    """``shard_model``'s policies from a strategy: its ``mixed_precision_policy`` and ``offload_policy``
    (None where it has none)."""
    return {
        "mp_policy": getattr(strategy, "mixed_precision_policy", None),
        "offload_policy": getattr(strategy, "offload_policy", None),
    }


def shard_model(model: torch.nn.Module, device_mesh: DeviceMesh, *, mp_policy=None, offload_policy=None) -> None:
    """Shard ``model`` in place over the mesh's data-parallel dimension; ``mp_policy``: FSDP2's
    ``MixedPrecisionPolicy`` (None keeps forward and backward in the parameters' dtype); ``offload_policy``:
    FSDP2's ``CPUOffloadPolicy`` (None keeps the shards on the device)."""
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
    for layer in decoder_layers(model):
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
