"""The rollout backends a run can name in ``rollout.backend``, each with what it supports.

A backend is an entry here: its name, the function that builds its engine (imported only when a run builds
one), and what it can do. Callers ask an entry (``backend.served``, ``backend.sleep_mode``, ...) instead of
comparing names, so adding a backend is one module with a builder plus one ``register_rollout_backend`` call
(docs/guides/extending.md shows one). ``auto`` is not a backend: it picks ``vllm`` where vLLM is usable, else
``hf`` (``rollout/factory.py``).

This module imports neither torch nor an engine, so the run's schema can check settings against it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from stare_lightning.rollout.adapters import AdapterSync
    from stare_lightning.rollout.base import RolloutEngine

__all__ = [
    "AUTO",
    "EngineContext",
    "ROLLOUT_BACKENDS",
    "SERVER_BACKEND",
    "VLLM_LORA_RANKS",
    "RolloutBackend",
    "backend_choices",
    "declared_backend",
    "register_rollout_backend",
]

AUTO = "auto"
# The ranks vLLM sizes its LoRA buffers for (``--max-lora-rank``); an adapter of a smaller rank fits the next one.
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
SERVER_BACKEND = "server"  # the stock vLLM servers' backend, which the ``serve`` command starts servers for


@dataclass(frozen=True)
class EngineContext:
    """What a builder gets besides ``rollout``'s settings: the trainer's policy and tokenizer, the model directory,
    the run's seed, the dtype the trainer computes in (a name such as ``bfloat16``; None only without a policy),
    where a backend that starts processes writes their logs, and, for a backend with ``adapter_ranks``, how to
    serve a LoRA policy's adapters (None: sync merged weights)."""

    policy: torch.nn.Module
    tokenizer: Any
    model_dir: str
    seed: int
    dtype: str | None
    log_dir: Path
    adapters: AdapterSync | None = None


@dataclass(frozen=True)
class RolloutBackend:
    """One ``rollout.backend`` choice.

    ``builder``: ``"module:function"``, a function ``(rollout: RolloutConfig, context: EngineContext) ->
    RolloutEngine``, imported when a run builds its engine. What it supports:
    ``served``: generation in processes of its own (asked to answer before the first step; collected by a
    producer beside the trainer, so ``rollout.max_staleness`` may exceed 0); else the engine lives in the
    trainer's processes and generates inside the step.
    ``holds_weight_copy``: the engine keeps its own copy of the weights, synced after each optimizer step (the HF
    engine generates with the trainer's own module instead).
    ``engine_kwargs``: ``rollout.engine_kwargs`` go to its engine. ``sleep_mode``: ``rollout.enable_sleep_mode``
    frees its GPU memory during the update. ``in_process_memory``: ``rollout.gpu_memory_utilization`` and
    ``rollout.tensor_parallel_size`` size an engine inside the trainer. ``server_settings``: ``rollout.server.*``
    configure it. ``tool_episodes``: multi-turn tool episodes run on it. ``lora``: a LoRA policy's merged weights
    can be synced into it. ``adapter_ranks``: the LoRA ranks it sizes adapter buffers for, ascending (an adapter of
    a smaller rank takes the next; above the last, none), when it can serve a LoRA policy's adapters over its base
    weights (``rollout.lora_sync=adapter``; its builder reads ``EngineContext.adapters``); empty: it serves none.
    ``preflight``: ``"module:function"`` taking the ``RolloutConfig``, run before any model is prepared (a running
    server that does not answer is named in seconds), or None.
    """

    name: str
    builder: str
    summary: str
    served: bool = False
    holds_weight_copy: bool = True
    engine_kwargs: bool = False
    sleep_mode: bool = False
    in_process_memory: bool = False
    server_settings: bool = False
    tool_episodes: bool = True
    lora: bool = True
    adapter_ranks: tuple[int, ...] = ()
    preflight: str | None = None

    @property
    def lora_adapters(self) -> bool:
        """Whether it serves a LoRA policy's adapters (at some rank)."""
        return bool(self.adapter_ranks)

    def adapter_rank(self, rank: int) -> int | None:
        """The adapter-buffer rank an adapter of ``rank`` is served at; None where it serves no adapter that large."""
        return next((size for size in self.adapter_ranks if size >= rank), None)

    # ``rollout`` is the run's ``RolloutConfig`` (not imported here: rollout/config.py checks settings against this
    # module, so the import would go both ways).
    def build(self, rollout: Any, context: EngineContext) -> RolloutEngine:
        return _load(self.builder, f"rollout backend {self.name!r}'s builder")(rollout, context)

    def check_before_model(self, rollout: Any) -> None:
        if self.preflight is not None:
            _load(self.preflight, f"rollout backend {self.name!r}'s preflight")(rollout)


def _load(path: str, what: str) -> Callable:
    module, _, name = path.partition(":")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as error:
        raise ImportError(f"{what} {path!r} cannot be imported: {error}") from error


ROLLOUT_BACKENDS: dict[str, RolloutBackend] = {}


def register_rollout_backend(backend: RolloutBackend, *, replace: bool = False) -> RolloutBackend:
    """Make ``backend`` a ``rollout.backend`` choice (register before the run's config is checked, e.g. in the
    module your command imports). A name already taken is refused unless ``replace``."""
    name = backend.name
    if not isinstance(name, str) or not name.isidentifier() or name == AUTO:
        raise ValueError(f"rollout backend name {name!r} is not allowed: an identifier other than {AUTO!r}")
    if ":" not in backend.builder:
        raise ValueError(f"rollout backend {name!r}: builder {backend.builder!r} must be 'module:function'")
    if name in ROLLOUT_BACKENDS and not replace:
        raise ValueError(f"rollout backend {name!r} is registered already (pass replace=True to replace it)")
    ROLLOUT_BACKENDS[name] = backend
    return backend


def backend_choices() -> tuple[str, ...]:
    """What ``rollout.backend`` accepts."""
    return (AUTO, *ROLLOUT_BACKENDS)


def declared_backend(name: str) -> RolloutBackend | None:
    """The entry a run names; None for ``auto``, which resolves when the engine is built."""
    return None if name == AUTO else ROLLOUT_BACKENDS[name]


register_rollout_backend(
    RolloutBackend(
        name="vllm",
        builder="stare_lightning.rollout.vllm:build_vllm_engine",
        summary="vLLM inside every trainer rank (colocated), weights synced after each optimizer step",
        engine_kwargs=True,
        sleep_mode=True,
        in_process_memory=True,
        adapter_ranks=VLLM_LORA_RANKS,
    )
)
register_rollout_backend(
    RolloutBackend(
        name="hf",
        builder="stare_lightning.rollout.hf:build_hf_engine",
        summary="Hugging Face generate with the trainer's own policy module (no copy, slow)",
        holds_weight_copy=False,
    )
)
register_rollout_backend(
    RolloutBackend(
        name=SERVER_BACKEND,
        builder="stare_lightning.rollout.server.trainer_side.connect:build_server_engine",
        summary="stock vLLM servers, launched with the run or running elsewhere; weights pushed over HTTP and files",
        served=True,
        server_settings=True,
        adapter_ranks=VLLM_LORA_RANKS,
        preflight="stare_lightning.rollout.server.trainer_side.connect:check_running_servers",
    )
)
