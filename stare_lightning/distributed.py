"""The one place that asks whether ``torch.distributed`` is running.

Every collective here is the identity on a single process, so the training step reads the same with one
rank or many. All ranks of the default process group must make the same calls in the same order.

A thread that runs collectives beside the training loop (the asynchronous rollout producer, step/producer.py) runs
them on a process group of its own, set for that thread with ``collectives_on``: two threads taking turns on one
group would interleave their calls in a different order on each rank.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

_thread = threading.local()


@contextmanager
def collectives_on(group) -> Iterator[None]:
    """Inside the block, this thread's collectives run on ``group`` (a group over every rank; None: the default)."""
    before = getattr(_thread, "group", None)
    _thread.group = group
    try:
        yield
    finally:
        _thread.group = before


def _group():
    return getattr(_thread, "group", None)


def new_side_group():
    """A gloo group over every rank for a thread's ``collectives_on`` (every rank calls this, in the same order), or
    None on one process."""
    if not is_distributed():
        return None
    return dist.new_group(backend="gloo")


def process_group_exists() -> bool:
    """True when ``torch.distributed`` has a default process group (of any size)."""
    return dist.is_available() and dist.is_initialized()


def is_distributed() -> bool:
    """True when a process group with more than one rank is running."""
    return process_group_exists() and dist.get_world_size() > 1


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def all_reduce(tensor: Tensor, op=dist.ReduceOp.SUM, device: torch.device | None = None) -> Tensor:
    """``tensor`` reduced over all ranks (moved to ``device`` first: NCCL reduces only GPU tensors)."""
    if not is_distributed():
        return tensor
    if _group() is not None:  # a side thread's group is gloo: it reduces host tensors
        device = None
    tensor = tensor.to(device) if device is not None else tensor.clone()
    dist.all_reduce(tensor, op=op, group=_group())
    return tensor


def all_ranks_agree(flag: bool, device: torch.device | None = None) -> bool:
    """True only when ``flag`` is true on every rank."""
    return bool(all_reduce(torch.tensor(float(flag)), dist.ReduceOp.MIN, device) > 0)


def all_gather_objects(obj: Any) -> list[Any]:
    """Every rank's ``obj`` (picklable), in rank order; ``[obj]`` on one process."""
    if not is_distributed():
        return [obj]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj, group=_group())
    return gathered


def gather_variable_length(t: Tensor) -> Tensor:
    """All ranks' 1-D tensors concatenated in rank order (``t`` itself on one process). No gradient flows.

    Each rank's tensor is padded to the longest for ``all_gather``, then the padding is stripped.
    """
    if t.dim() != 1:
        raise ValueError(f"t has shape {tuple(t.shape)}; expected a 1-D tensor")
    if not is_distributed():
        return t
    world = dist.get_world_size()
    n = torch.tensor([t.numel()], dtype=torch.long, device=t.device)
    sizes = [torch.zeros_like(n) for _ in range(world)]
    dist.all_gather(sizes, n, group=_group())
    lengths = [int(s.item()) for s in sizes]
    longest = max(lengths)
    if longest == 0:
        return t
    padded = torch.zeros(longest, dtype=t.dtype, device=t.device)
    padded[: t.numel()] = t.detach()
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded, group=_group())
    return torch.cat([p[:k] for p, k in zip(parts, lengths)])


def row_offset(num_rows: int, device: torch.device | None = None) -> tuple[int, int]:
    """Where this rank's rows start in the global batch (ranks in order), and the global row count."""
    counts = torch.zeros(world_size(), dtype=torch.long)
    counts[rank()] = num_rows
    counts = all_reduce(counts, device=device).tolist()
    return sum(counts[: rank()]), sum(counts)
