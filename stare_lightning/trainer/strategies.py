"""``FSDP2Strategy``: Lightning's ``ModelParallelStrategy`` with every rank in one data-parallel group.

Lightning's ``"auto"`` sizes give one data-parallel group per node and tensor parallelism inside it. For
FSDP-only training (``fully_shard`` over all ranks) the data-parallel size must be the world size divided by
the tensor-parallel size, which this subclass fills in when left at ``"auto"``.

Mixed precision the FSDP2 way: ``param_dtype`` (e.g. ``bfloat16``) is the dtype parameters are all-gathered
and computed in, while the sharded parameters, gradients and optimizer state stay in their own dtype
(fp32) and gradients are reduced in ``reduce_dtype``. ``configure_model`` reads ``mixed_precision_policy``
when it shards the models. Use it with ``trainer.precision=32-true``: Lightning's ``bf16-mixed`` would add
autocast on top.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.strategies import ModelParallelStrategy

from stare_lightning.config.checks import choice

_DTYPES = ("float32", "bfloat16", "float16")


class FSDP2Strategy(ModelParallelStrategy):
    def __init__(
        self,
        data_parallel_size: Any = "auto",
        tensor_parallel_size: int = 1,
        param_dtype: str | None = None,
        reduce_dtype: str = "float32",
        **kwargs: Any,
    ) -> None:
        choice("trainer.strategy.param_dtype", param_dtype, (*_DTYPES, None))
        choice("trainer.strategy.reduce_dtype", reduce_dtype, _DTYPES)
        super().__init__(data_parallel_size=data_parallel_size, tensor_parallel_size=tensor_parallel_size, **kwargs)
        self.param_dtype = param_dtype
        self.reduce_dtype = reduce_dtype

    @property
    def mixed_precision_policy(self):
        """FSDP2's ``MixedPrecisionPolicy`` for ``param_dtype``, or None to compute in the parameters' dtype."""
        if self.param_dtype is None:
            return None
        from torch.distributed.fsdp import MixedPrecisionPolicy

        return MixedPrecisionPolicy(
            param_dtype=getattr(torch, self.param_dtype), reduce_dtype=getattr(torch, self.reduce_dtype)
        )

    def setup_environment(self) -> None:
        if self._data_parallel_size == "auto":
            self._data_parallel_size = self.num_nodes * self.num_processes // int(self._tensor_parallel_size)
        super().setup_environment()
