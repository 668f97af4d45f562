"""``rollout.lora_sync``: how a LoRA policy's weights reach the rollout engine, every rule of it in this module.

``merged`` syncs the whole model with the adapters folded in (``models/lora.py``); ``adapter`` syncs the adapters only,
served by the engine as a vLLM LoRA over the base weights it loaded (``adapters.py``); ``auto`` picks adapters on GPUs
where the backend serves them at the policy's rank, merged weights otherwise.

What a setting can be told from the config alone is refused when the config is checked: by the ``rollout`` group
(``check_backend_takes``: the backend named) and by the run's schema (``check_policy``: with ``model.lora``). What
depends on the machine (a GPU) or on ``rollout.backend=auto``'s resolution is decided when the engine is built
(``adapter_sync``). The largest rank served is the backend entry's (``RolloutBackend.adapter_ranks``).

This module imports neither torch nor an engine, so the run's schema can check settings with it. ``rollout`` is the
run's ``RolloutConfig``, not imported here: rollout/config.py checks its settings with this module.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from stare_lightning.rollout.backends import ROLLOUT_BACKENDS, RolloutBackend, declared_backend

if TYPE_CHECKING:
    from stare_lightning.models.config import LoraConfig
    from stare_lightning.rollout.adapters import AdapterSync

__all__ = ["LORA_SYNC_MODES", "adapter_sync", "check_adapter_rank", "check_backend_takes", "check_policy"]

LORA_SYNC_MODES = ("auto", "adapter", "merged")


def check_backend_takes(mode: str, backend: RolloutBackend | None, name: str) -> None:
    """Refuse ``rollout.lora_sync=mode`` with the backend the run names (``name``; ``backend`` None for ``auto``)."""
    if backend is None:
        return
    if mode != "auto" and not backend.holds_weight_copy:
        raise ValueError(
            f"rollout.lora_sync={mode} does nothing with rollout.backend={name}: it generates with the "
            "trainer's own module, so no weights are synced; leave it at auto"
        )
    if mode == "adapter" and not backend.lora_adapters:
        raise ValueError(
            f"rollout.lora_sync=adapter needs a backend that serves LoRA adapters; rollout.backend={name} does "
            "not: use lora_sync=merged, or rollout=vllm or rollout=server"
        )


def check_policy(rollout: Any, lora: LoraConfig | None) -> None:
    """Refuse what ``rollout.lora_sync`` and the backend cannot do with the run's policy (``model.lora``; None: no
    LoRA)."""
    backend = declared_backend(rollout.backend)
    if lora is None and rollout.lora_sync != "auto":
        raise ValueError(
            f"rollout.lora_sync={rollout.lora_sync} does nothing without LoRA (model.lora.rank=0): it says "
            "how a LoRA policy's weights reach the engine; leave it at auto, or set model.lora.rank > 0"
        )
    if backend is not None and lora is not None and not backend.lora:
        raise ValueError(
            f"model.lora.rank={lora.rank} needs a rollout backend that takes a LoRA policy's merged "
            f"weights; rollout.backend={backend.name} does not"
        )
    if rollout.lora_sync == "adapter":
        # rollout.backend=auto serves adapters only where it resolves to vLLM (HF serves none: refused when built).
        check_adapter_rank(lora, backend or ROLLOUT_BACKENDS["vllm"])


def check_adapter_rank(lora: LoraConfig, backend: RolloutBackend) -> int:
    """The adapter-buffer rank ``backend`` serves ``lora``'s adapters at; refused where it serves none that large."""
    served = backend.adapter_rank(lora.rank)
    if served is None:
        raise ValueError(
            f"rollout.lora_sync=adapter cannot serve model.lora.rank={lora.rank}: vLLM serves LoRA "
            f"adapters up to rank {backend.adapter_ranks[-1]}; use rollout.lora_sync=merged, or a smaller rank"
        )
    return served


def adapter_sync(
    rollout: Any, lora: LoraConfig | None, backend: RolloutBackend, *, on_gpu: bool | None = None
) -> AdapterSync | None:
    """How the engine of ``backend`` (``rollout.backend`` resolved) serves a LoRA policy's adapters, or None to sync
    merged weights (no LoRA; ``lora_sync=merged``; ``auto`` on a backend that serves no adapters, without a GPU, or at
    a rank the backend does not serve). ``on_gpu``: whether the engine runs on GPUs (default: whether this process
    sees one)."""
    mode = rollout.lora_sync
    if lora is None or mode == "merged":
        return None
    if mode == "auto" and (not backend.lora_adapters or backend.adapter_rank(lora.rank) is None):
        return None  # a backend without adapters, or a rank above what it serves: merged weights
    if mode == "auto" and not (_sees_gpu() if on_gpu is None else on_gpu):
        # vLLM's LoRA kernels on a CPU are plain torch: SmolLM2 at rank 16 took 83 s a step against 28 s merged
        # (benchmarks/bench_lora.py), far more than the half second a merged sync costs. So auto means adapters on
        # GPUs only; lora_sync=adapter asks for them anyway.
        return None
    if not backend.lora_adapters:  # rollout.backend=auto resolved to an engine without adapters
        raise ValueError(
            f"rollout.lora_sync=adapter needs an engine that serves LoRA adapters; rollout.backend={rollout.backend} "
            f"resolved to {backend.name}, which does not: use rollout=vllm or rollout=server, or lora_sync=merged"
        )
    from stare_lightning.rollout.adapters import AdapterSync

    return AdapterSync.of(lora, check_adapter_rank(lora, backend), max_staleness=rollout.max_staleness)


def _sees_gpu() -> bool:
    import torch

    return torch.cuda.is_available()
