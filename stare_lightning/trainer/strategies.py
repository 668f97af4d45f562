"""``FSDP2Strategy``: Lightning's ``ModelParallelStrategy`` with every rank in one data-parallel group.

Lightning's ``"auto"`` sizes give one data-parallel group per node and tensor parallelism inside it. For
FSDP-only training (``fully_shard`` over all ranks) the data-parallel size must be the world size divided by
the tensor-parallel size, which this subclass fills in when left at ``"auto"``.

Mixed precision the FSDP2 way: ``param_dtype`` (e.g. ``bfloat16``) is the dtype parameters are all-gathered
and computed in, while the sharded parameters, gradients and optimizer state stay in their own dtype
(fp32) and gradients are reduced in ``reduce_dtype``. ``configure_model`` reads ``mixed_precision_policy``
when it shards the models. Use it with ``trainer.precision=32-true``: Lightning's ``bf16-mixed`` would add
autocast on top.

CPU offload (``cpu_offload=True``): FSDP2's ``CPUOffloadPolicy`` keeps the sharded parameters, gradients and
optimizer state in pinned host memory; each layer is copied to the GPU for its all-gather, and the optimizer
steps on the CPU. GPU memory then holds one gathered layer at a time plus activations, at the price of
host-device copies and a CPU optimizer step. The shards must stay on the host, so ``model_to_device`` moves
only buffers (rotary tables) to the GPU; and the process group gets a gloo backend for CPU tensors besides
NCCL, because gradient-norm clipping reduces the offloaded gradients' norms where they live.

Loading a checkpoint that leaves out the frozen base (a LoRA run's, ``trainer/frozen_base.py``): Lightning asks
a distributed checkpoint for every key of the module and fails on the first one missing, and a single file's
strict load fails too. This strategy checks that the keys the checkpoint lacks are all frozen, then loads the ones
it holds; the frozen tensors stay as the model directory gave them, and the module's ``on_load_checkpoint``
checks that directory's fingerprint against the one the checkpoint recorded.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.strategies import ModelParallelStrategy

from stare_lightning.config.checks import choice, flag, number
from stare_lightning.trainer.checkpoint_trust import (
    LIGHTNING_META_FILE,
    DataOnlyLoadPlanner,
    DataOnlyReader,
    load_file,
    read_metadata,
)
from stare_lightning.trainer.frozen_base import RECORD, RUN_STATE, frozen_keys, recorded_base
from stare_lightning.trainer.rendezvous import rendezvous_deadline

_DTYPES = ("float32", "bfloat16", "float16")
# NCCL for the GPU collectives, gloo for those on offloaded (host) tensors.
_OFFLOAD_BACKEND = "cuda:nccl,cpu:gloo"


class FSDP2Strategy(ModelParallelStrategy):
    """FSDP2 (``fully_shard``) over every rank through Lightning's ``ModelParallelStrategy`` (module docstring).

    Args:
        data_parallel_size: ranks per data-parallel group; ``auto``: the world size over ``tensor_parallel_size``.
        tensor_parallel_size: ranks per tensor-parallel group (1: FSDP only, what this project trains with).
        param_dtype: the dtype parameters are gathered and computed in (``bfloat16``, ``float16``, ``float32``);
            null: the parameters' own dtype, exact fp32.
        reduce_dtype: the dtype gradients are reduced in.
        cpu_offload: keep the sharded weights, gradients and optimizer state in host memory (GPUs only).
        rendezvous_timeout: seconds the ranks may take to meet at the start before each ends with one line
            naming the address and port it waited at (``trainer/rendezvous.py``).
        save_distributed_checkpoint: each rank writes its own shard (a checkpoint directory) instead of one
            gathered file; passed to ``ModelParallelStrategy``.
    """

    def __init__(
        self,
        data_parallel_size: Any = "auto",
        tensor_parallel_size: int = 1,
        param_dtype: str | None = None,
        reduce_dtype: str = "float32",
        cpu_offload: bool = False,
        rendezvous_timeout: float = 600.0,
        **kwargs: Any,
    ) -> None:
        choice("trainer.strategy.param_dtype", param_dtype, (*_DTYPES, None))
        choice("trainer.strategy.reduce_dtype", reduce_dtype, _DTYPES)
        flag("trainer.strategy.cpu_offload", cpu_offload)
        number("trainer.strategy.rendezvous_timeout", rendezvous_timeout, low=0.0, low_open=True)
        if cpu_offload and kwargs.get("process_group_backend") is None:
            kwargs["process_group_backend"] = _OFFLOAD_BACKEND
        super().__init__(data_parallel_size=data_parallel_size, tensor_parallel_size=tensor_parallel_size, **kwargs)
        self.param_dtype = param_dtype
        self.reduce_dtype = reduce_dtype
        self.cpu_offload = cpu_offload
        self.rendezvous_timeout = rendezvous_timeout

    @property
    def mixed_precision_policy(self):
        """FSDP2's ``MixedPrecisionPolicy`` for ``param_dtype``, or None to compute in the parameters' dtype."""
        if self.param_dtype is None:
            return None
        from torch.distributed.fsdp import MixedPrecisionPolicy

        return MixedPrecisionPolicy(
            param_dtype=getattr(torch, self.param_dtype), reduce_dtype=getattr(torch, self.reduce_dtype)
        )

    @property
    def offload_policy(self):
        """FSDP2's ``CPUOffloadPolicy`` with ``cpu_offload``, else None (everything stays on the device)."""
        if not self.cpu_offload:
            return None
        from torch.distributed.fsdp import CPUOffloadPolicy

        return CPUOffloadPolicy()

    def model_to_device(self) -> None:
        if not self.cpu_offload:
            return super().model_to_device()
        # FSDP2 refuses offloaded shards that are not on the host; buffers are not sharded and compute on the GPU.
        for module in self.model.modules():
            for name, buffer in module.named_buffers(recurse=False):
                module._buffers[name] = buffer.to(self.root_device)

    def setup_environment(self) -> None:
        if self.cpu_offload and self.root_device.type != "cuda":
            raise ValueError(
                f"trainer.strategy.cpu_offload=true needs CUDA devices, but this run's device is {self.root_device}: "
                "offload moves GPU-resident shards to the host, and here they are on the host already"
            )
        if self.param_dtype == "float16" and self.root_device.type != "cuda":
            raise ValueError(
                f"trainer.strategy.param_dtype=float16 needs CUDA devices; this run's device is {self.root_device}: "
                "fp16 compute is for GPUs here (vLLM's CPU backend has no float16 kernels); use bfloat16 or null"
            )
        if self._data_parallel_size == "auto":
            self._data_parallel_size = self.num_nodes * self.num_processes // int(self._tensor_parallel_size)
        super().setup_environment()

    def _setup_distributed(self) -> None:
        world_size = self.num_nodes * self.num_processes
        with rendezvous_deadline(self.cluster_environment, world_size, self.rendezvous_timeout):
            super()._setup_distributed()

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        path = Path(self.broadcast(checkpoint_path))
        sharded = (path / LIGHTNING_META_FILE).is_file()
        saved = _saved_contents(path, sharded)
        if saved is None:  # not a checkpoint: Lightning's load says so
            return super().load_checkpoint(path, weights_only=weights_only)
        saved_keys, run_meta = saved
        module_state = get_model_state_dict(self.model)
        absent = _absent_frozen_keys(path, saved_keys, module_state.keys(), frozen_keys(self.model))
        if not absent:
            return super().load_checkpoint(path, weights_only=weights_only)
        _require_base_record(path, run_meta)
        if sharded:
            self._load_sharded(path, {key: value for key, value in module_state.items() if key not in absent})
            return run_meta
        # One file: Lightning's load skips the keys a file lacks when not strict; the frozen ones are all it lacks.
        module = self.lightning_module
        strict, module.strict_loading = module.strict_loading, False
        try:
            return super().load_checkpoint(path, weights_only=weights_only)
        finally:
            module.strict_loading = strict

    def _load_sharded(self, path: Path, module_state: dict[str, Any]) -> None:
        """The module's ``module_state`` keys and every optimizer's state from the distributed checkpoint."""
        from torch.distributed.checkpoint import load
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_optimizer_state_dict,
            set_optimizer_state_dict,
        )

        load({"state_dict": module_state}, storage_reader=DataOnlyReader(path), planner=DataOnlyLoadPlanner())
        self.model.load_state_dict(module_state, strict=False)
        for index, optimizer in enumerate(self.optimizers):
            key = f"optimizer_{index}"
            optimizer_state = {key: get_optimizer_state_dict(self.model, optimizer)}
            load(optimizer_state, storage_reader=DataOnlyReader(path), planner=DataOnlyLoadPlanner())
            options = StateDictOptions(cpu_offload=True)
            set_optimizer_state_dict(self.model, optimizer, optim_state_dict=optimizer_state[key], options=options)


def _saved_contents(path: Path, sharded: bool) -> tuple[set[str], dict[str, Any]] | None:
    """The module state-dict keys a checkpoint holds and its non-tensor state (a distributed checkpoint's
    ``meta.pt``, a file's whole content, read as data only: trainer/checkpoint_trust.py); None when ``path`` is no
    checkpoint."""
    if sharded:
        names = read_metadata(path).state_dict_metadata
        keys = {name.removeprefix("state_dict.") for name in names if name.startswith("state_dict.")}
        return keys, load_file(path / LIGHTNING_META_FILE)
    if path.is_file():
        whole = load_file(path, mmap=True)
        return set(whole.get("state_dict", {})), whole
    return None


def _absent_frozen_keys(path: Path, saved: set[str], module_keys: Iterable[str], frozen: Iterable[str]) -> set[str]:
    """The module's keys the checkpoint lacks, refused unless all are frozen; a key the module lacks is refused too
    (a non-strict load would drop it: e.g. the adapters of a module no longer in ``model.lora.target_modules``)."""
    module_keys = set(module_keys)
    unexpected = sorted(saved - module_keys)
    if unexpected:
        raise ValueError(
            f"{path} holds weights this run's model does not have: {_some(unexpected)}. Resume with the model "
            "settings it was written with (model.name_or_path, model.lora)"
        )
    absent = module_keys - saved
    trained = sorted(absent - set(frozen))
    if trained:
        raise ValueError(f"{path} lacks trained weights: {_some(trained)}")
    return absent


def _require_base_record(path: Path, checkpoint: dict[str, Any]) -> None:
    """A checkpoint without the frozen base must say which base it left out (trainer/frozen_base.py)."""
    if recorded_base(checkpoint) is None:
        raise ValueError(
            f"{path} lacks the model's frozen weights but does not record the base model it left out "
            f"({RUN_STATE}.{RECORD}), so nothing says which weights its adapters belong to"
        )


def _some(keys: list[str]) -> str:
    return f"{keys[:5]}{' ...' if len(keys) > 5 else ''}"
