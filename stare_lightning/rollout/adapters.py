"""Adapter-only weight sync for a LoRA policy (``rollout.lora_sync=adapter``).

After each optimizer step the engine gets the low-rank adapters (a few MB) instead of the whole merged model
(``rollout.lora_sync=merged``, ``models/lora.py``), and vLLM applies them as a LoRA over the base weights it loaded
at its start, which are the policy's frozen base.

Files. vLLM loads an adapter from a directory in peft's format: ``adapter_config.json`` and
``adapter_model.safetensors`` under peft's saved names (``base_model.model.<layer>.lora_A.weight``). Every weight
version is written into a sub-directory of its own in a private transfer directory (``transfer_dir.py``: mode
0700, every file created through a descriptor), loaded under a new name, and deleted once no longer served
(``adapter_versions.py`` runs that lifecycle for both engines).

Versions. ``rollout.max_staleness + 1`` versions stay loaded (vLLM's ``max_loras``); older ones are unloaded before
their files go, and a run's last versions when it ends, from servers it did not launch. This project's producer
pushes between batches only (``step/producer.py``), so no request is in flight across a push and one version would
do; the window costs K adapters (a few MB each) and keeps a request's adapter loaded should a push ever come while
it runs, where vLLM's LRU would otherwise evict the version the request named.

Numerics: vLLM adds ``scaling * B (A x)`` to the base layer's output where the merged mode folds ``scaling * B A``
into ``W``; the same function up to rounding, and the log-prob canary compares the served log-probs with the
trainer's in both modes.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from stare_lightning.models.config import LoraConfig
from stare_lightning.models.lora import ADAPTER, PEFT_PREFIX
from stare_lightning.rollout.transfer_dir import ChunkDirectory
from stare_lightning.rollout.weights import checkpoint_name, full_tensor

__all__ = ["AdapterSync", "adapter_weights", "write_adapter"]

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"


@dataclass(frozen=True)
class AdapterSync:
    """What an engine needs to serve a LoRA policy's adapters: their shape, the adapter-buffer rank they are served at
    (the backend entry's, ``lora_sync.check_adapter_rank``) and how many versions stay loaded."""

    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    versions: int  # loaded at once: max_staleness + 1
    max_lora_rank: int  # vLLM's --max-lora-rank: the smallest rank the backend serves >= rank

    @classmethod
    def of(cls, lora: LoraConfig, max_lora_rank: int, *, max_staleness: int = 0) -> AdapterSync:
        alpha = lora.scaling * lora.rank  # peft's lora_alpha: scaling = alpha / rank, as apply_lora sets it
        return cls(lora.rank, alpha, tuple(lora.target_modules), max_staleness + 1, max_lora_rank)

    def vllm_kwargs(self) -> dict:
        """``vllm.LLM``'s LoRA arguments."""
        return dict(
            enable_lora=True,
            max_lora_rank=self.max_lora_rank,
            max_loras=self.versions,
            max_cpu_loras=self.versions,
        )

    def server_args(self) -> list[str]:
        """The same, on a vLLM server's command line."""
        buffers = ["--max-lora-rank", str(self.max_lora_rank)]
        return ["--enable-lora", *buffers, "--max-loras", str(self.versions), "--max-cpu-loras", str(self.versions)]

    def peft_config(self) -> dict:
        """``adapter_config.json``: what vLLM reads of peft's LoRA config."""
        return {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "r": self.rank,
            "lora_alpha": self.alpha,
            "lora_dropout": 0.0,
            "target_modules": list(self.target_modules),
            "bias": "none",
            "use_rslora": False,
            "use_dora": False,
            "modules_to_save": None,
        }


def adapter_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name as peft saves it, full tensor)`` for every adapter matrix of ``model``, in module order. FSDP2
    shards are gathered one at a time, so every rank runs this loop to the end."""
    marker = f".{ADAPTER}."
    found = False
    for name, param in model.named_parameters():
        name = checkpoint_name(name)
        if ".lora_A." in name or ".lora_B." in name:
            found = True
            yield name.replace(marker, "."), full_tensor(param.detach())
        elif ".lora_" in name:  # embedding adapters, DoRA magnitudes: the engine would serve another policy
            raise ValueError(
                f"rollout.lora_sync=adapter cannot serve {name}: only linear layers' lora_A/lora_B adapters are "
                "served; adapt linear layers only (model.lora.target_modules) or use rollout.lora_sync=merged"
            )
    if not found:
        raise ValueError("rollout.lora_sync=adapter needs a LoRA policy; this one has no adapters")


@dataclass(frozen=True)
class AdapterFiles:
    path: Path
    bytes: int  # the tensors' bytes, what a sync moves
    contents: dict[str, bytes]  # each file's bytes, by name: what a server on another host is sent


def write_adapter(
    directory: ChunkDirectory, name: str, weights: Iterable[tuple[str, torch.Tensor]], sync: AdapterSync
) -> AdapterFiles:
    """Write one version's adapter into a new sub-directory ``name`` of ``directory``, as vLLM loads it."""
    from safetensors.torch import save

    tensors = {}
    for tensor_name, tensor in weights:
        if not tensor_name.startswith(PEFT_PREFIX):
            raise ValueError(f"adapter tensor {tensor_name!r} is not under peft's {PEFT_PREFIX!r}")
        tensors[tensor_name] = tensor.detach().to("cpu").contiguous()
    contents = {CONFIG_FILE: json.dumps(sync.peft_config()).encode(), WEIGHTS_FILE: save(tensors)}
    with directory.create_directory(name) as adapter:
        for file, data in contents.items():
            with adapter.create(file) as out:
                out.write(data)
        path = adapter.path
    return AdapterFiles(path, sum(t.numel() * t.element_size() for t in tensors.values()), contents)
