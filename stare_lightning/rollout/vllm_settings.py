"""What ``VLLMRolloutEngine`` asks vLLM for: its settings per platform and per trainer rank, and each request's.

Chunked prefill is off on CPU: vLLM spreads a prompt over steps, samples at each unfinished one, then drops the
token and rewinds the request's generator (``_bookkeeping_sync``), which CPU generators cannot do, so seeded
requests (all here) crash. Unchunked, a prompt is prefilled whole; samples are unchanged. GPUs keep the default.

Under several trainer ranks each rank runs an engine of its own that joins the trainer's process group
(``external_launcher``), seeded by its data-parallel rank.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from stare_lightning.distributed import is_distributed
from stare_lightning.rollout.base import SamplingParams

logger = logging.getLogger(__name__)
_DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30
SPLIT_PREFILL = (
    "vLLM cannot rewind a seeded CPU generator after a chunked prefill step; keep chunked prefill off on CPU "
    "(the default: drop enable_chunked_prefill and long_prefill_token_threshold from rollout.engine_kwargs)"
)


def request_params(params: SamplingParams, seed: int | None, budget: int):
    """vLLM's sampling settings of one prompt."""
    from vllm import SamplingParams as VLLMSamplingParams

    return VLLMSamplingParams(
        n=params.n,
        max_tokens=budget,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k if params.top_k > 0 else -1,
        seed=seed,
        logprobs=0,  # the sampled token's log-prob only
        detokenize=True,
        skip_special_tokens=True,
        stop=list(params.stop) or None,
        include_stop_str_in_output=True,  # the text ends with the call it closes, like the tokens
    )


def platform_kwargs(on_cpu: bool, kv_cache_memory_bytes: int | None, llm_kwargs: dict) -> dict[str, Any]:
    """The KV-cache size and, on CPU, chunked prefill off (module docstring), under the caller's ``llm_kwargs``."""
    if on_cpu and kv_cache_memory_bytes is None:
        kv_cache_memory_bytes = _DEFAULT_CPU_KV_CACHE_BYTES
    kwargs = {} if kv_cache_memory_bytes is None else {"kv_cache_memory_bytes": int(kv_cache_memory_bytes)}
    kwargs.update({"enable_chunked_prefill": False} if on_cpu else {}, **llm_kwargs)
    if on_cpu and (kwargs.get("enable_chunked_prefill") or kwargs.get("long_prefill_token_threshold")):
        logger.warning("vLLM engine on CPU set to split prefills over steps: %s", SPLIT_PREFILL)
    return kwargs


@contextmanager
def explain_generator_rewind() -> Iterator[None]:
    """Name the cause when vLLM fails to rewind a CPU generator (chunked prefill turned back on)."""
    try:
        yield
    except RuntimeError as err:
        if "does not use offset" not in str(err):
            raise
        raise RuntimeError(f"{err}: {SPLIT_PREFILL}; this engine is unusable now") from err


def rank_kwargs(seed: int, tensor_parallel_size: int) -> dict[str, Any]:
    """Under several trainer ranks: one engine per rank, joining the trainer's process group."""
    if not is_distributed():
        return {}
    rank = torch.distributed.get_rank()
    os.environ.setdefault("RANK", str(rank))
    os.environ.setdefault("LOCAL_RANK", str(_local_rank(rank)))
    return {"distributed_executor_backend": "external_launcher", "seed": seed + rank // tensor_parallel_size}


def _local_rank(rank: int) -> int:
    if torch.cuda.is_available() and torch.cuda.device_count():
        return rank % torch.cuda.device_count()
    return rank
