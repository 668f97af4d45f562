"""``rollout.engine_kwargs``: more ``vllm.LLM`` arguments, and what is refused of them without importing vLLM (not a
mapping, a key the project sets itself, any key with a backend that takes none). ``vllm.check_engine_kwargs`` checks
the keys against the installed vLLM where the engine is built."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from stare_lightning.rollout.backends import backend_choices, declared_backend

# vllm.LLM arguments the project sets itself, and where each comes from.
ENGINE_OWNED_KEYS = {
    "model": "use model.name_or_path",
    "tokenizer": "the tokenizer is the model's: use model.name_or_path",
    "dtype": "the engine computes in the trainer's dtype: use trainer.precision or model.dtype",
    "seed": "use seed (the engine's seed follows the run's)",
    "enable_sleep_mode": "use rollout.enable_sleep_mode",
    "gpu_memory_utilization": "use rollout.gpu_memory_utilization",
    "tensor_parallel_size": "use rollout.tensor_parallel_size",
    "logprobs_mode": "the engine needs processed_logprobs (its log-probs must be the trainer's)",
    "distributed_executor_backend": "the engine sets it (external_launcher under several trainer ranks)",
    "skip_tokenizer_init": "the engine needs its tokenizer to return response texts",
    **dict.fromkeys(
        ("enable_lora", "max_lora_rank", "max_loras", "max_cpu_loras"),
        "set from model.lora and rollout.max_staleness when rollout.lora_sync serves adapters",
    ),
}
# Shown when a key is unknown (those the installed vLLM has).
COMMON_ENGINE_KEYS = (
    "max_num_batched_tokens",
    "enable_chunked_prefill",
    "max_model_len",
    "max_num_seqs",
    "kv_cache_memory_bytes",
    "enable_prefix_caching",
    "enforce_eager",
)


def plain(value: Any) -> Any:
    """OmegaConf containers (and any other mapping or list) as plain dicts and lists, all the way down."""
    if isinstance(value, Mapping):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):  # ListConfig is a Sequence
        return [plain(v) for v in value]
    return value


def checked_engine_kwargs(value: Any, backend: str) -> dict[str, Any]:
    """``rollout.engine_kwargs`` as a plain dict, after the checks that need no vLLM."""
    if not isinstance(value, Mapping):
        raise ValueError(f"rollout.engine_kwargs={value!r} is not allowed: must be a mapping of vllm.LLM arguments")
    kwargs = plain(value)
    refuse_owned_engine_keys(kwargs)
    entry = declared_backend(backend) if backend in backend_choices() else None
    if kwargs and entry is not None and not entry.engine_kwargs and not entry.served:
        raise ValueError(
            f"rollout.engine_kwargs={kwargs} is not allowed with rollout.backend={backend}: these settings go to the "
            f"vLLM engine, which the {backend} backend does not use, so they would do nothing; remove them or use "
            "rollout=vllm"
        )
    return kwargs


def refuse_owned_engine_keys(engine_kwargs: Mapping[str, Any]) -> None:
    """Refuse keys that are not argument names or that the project sets itself (naming the setting to use)."""
    for key in engine_kwargs:
        if not isinstance(key, str) or not key.isidentifier():
            raise ValueError(f"rollout.engine_kwargs.{key} is not allowed: keys are vllm.LLM argument names")
        if key in ENGINE_OWNED_KEYS:
            raise ValueError(
                f"rollout.engine_kwargs.{key} is not allowed: the project sets it; {ENGINE_OWNED_KEYS[key]}"
            )
