"""``FSDP2Strategy``: Lightning's ``ModelParallelStrategy`` with every rank in one data-parallel group.

Lightning's ``"auto"`` sizes give one data-parallel group per node and tensor parallelism inside it. For
FSDP-only training (``fully_shard`` over all ranks) the data-parallel size must be the world size divided by
the tensor-parallel size, which this subclass fills in when left at ``"auto"``.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.strategies import ModelParallelStrategy


class FSDP2Strategy(ModelParallelStrategy):
    def __init__(self, data_parallel_size: Any = "auto", tensor_parallel_size: int = 1, **kwargs: Any) -> None:
        super().__init__(data_parallel_size=data_parallel_size, tensor_parallel_size=tensor_parallel_size, **kwargs)

    def setup_environment(self) -> None:
        if self._data_parallel_size == "auto":
            self._data_parallel_size = self.num_nodes * self.num_processes // int(self._tensor_parallel_size)
        super().setup_environment()
