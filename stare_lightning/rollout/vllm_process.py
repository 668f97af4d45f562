"""What an in-process vLLM engine does to the trainer's process, contained.

Building the engine seeds Python/NumPy/torch RNGs, replaces ``torch.set_num_threads`` with a no-op and, on CPU,
drops torch to one thread: ``contain_engine_side_effects`` restores all three. Sampling draws from torch's global
generator for its per-request seeds: ``forked_rng`` keeps the trainer's stream from being consumed. Shutting the
engine down destroys every process group, the trainer's included: ``keep_trainer_process_group_on_shutdown``
narrows that to the engine's own workers. An eager CPU engine still compiles one sampler helper at its first request:
``sampler_helpers_eager`` runs it eagerly. Every in-place weight reload logs a warning about rotary embeddings,
which have no weights to load: ``quiet_rotary_reload_warning`` drops that line.
"""

from __future__ import annotations

import gc
import logging
import random
import weakref
from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def forked_rng(on_cpu: bool) -> Iterator[None]:
    devices = [] if on_cpu or not torch.cuda.is_available() else [torch.cuda.current_device()]
    with torch.random.fork_rng(devices=devices):
        yield


@contextmanager
def contain_engine_side_effects(on_cpu: bool) -> Iterator[None]:
    """Undo what building a vLLM engine does to the process: RNG seeding and torch thread settings."""
    import numpy as np

    py_state = random.getstate()
    np_state = np.random.get_state()
    set_num_threads = torch.set_num_threads
    threads = torch.get_num_threads()
    try:
        with forked_rng(on_cpu):
            yield
    finally:
        random.setstate(py_state)
        np.random.set_state(np_state)
        torch.set_num_threads = set_num_threads
        torch.set_num_threads(threads)


@contextmanager
def sampler_helpers_eager(eager_on_cpu: bool) -> Iterator[None]:
    """Run vLLM's ``torch.compile``-decorated sampler helpers eagerly while an eager CPU engine samples.

    ``enforce_eager`` leaves the model uncompiled, but vLLM still compiles the helper that ranks each sampled token
    among the vocabulary (``batched_count_greater_than``) at the first request: dynamo's trace, inductor's ISA probes
    (six child interpreters) and a C++ build, about 2.5 s of CPU in every process that builds an engine, for a kernel
    that saves a (tokens x vocabulary) boolean copy. That copy is small next to a CPU batch; on a GPU it is not, so
    a GPU engine keeps the compiled helper. The helper's result is an integer count, the same either way.
    """
    if not eager_on_cpu:
        yield
        return
    with torch.compiler.set_stance("force_eager"):
        yield


def keep_trainer_process_group_on_shutdown(llm) -> None:
    """Make engine shutdown leave ``torch.distributed`` alone when the process group is the trainer's.

    vLLM's in-process client shuts its engine core down when collected (or at exit), and that shutdown
    destroys every process group, the default one included. Under a multi-rank trainer the default group
    is the trainer's, so the finalizer is swapped for one that releases the engine's workers only.
    """
    client = getattr(llm.llm_engine, "engine_core", None)
    core = getattr(client, "engine_core", None)
    finalizer = getattr(client, "_finalizer", None)
    if core is None or finalizer is None:
        return
    finalizer.detach()
    client._finalizer = weakref.finalize(client, _release_engine_core, core)


def _release_engine_core(core) -> None:
    """``EngineCore.shutdown`` without its final ``cleanup_dist_env_and_memory`` step."""
    manager = getattr(core, "structured_output_manager", None)
    if manager is not None:
        manager.clear_backend()
    if getattr(core, "model_executor", None) is not None:
        core.model_executor.shutdown()
    if getattr(core, "scheduler", None) is not None:
        core.scheduler.shutdown()
    gc.unfreeze()
    gc.collect()


class _DropRotaryReloadWarning(logging.Filter):
    """Every in-place reload warns that rotary embeddings got no weights; they have none to get (their
    cos/sin cache is computed, not loaded), so the line is noise repeated at every optimizer step."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not (message.startswith("RotaryEmbedding") and "Failed to load weights" in message)


def quiet_rotary_reload_warning() -> None:
    logger = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    if not any(isinstance(f, _DropRotaryReloadWarning) for f in logger.filters):
        logger.addFilter(_DropRotaryReloadWarning())
