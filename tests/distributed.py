"""Run a function on several gloo ranks (one process each) and collect what every rank returns.

``fn(rank, world, *args)`` must be a module-level function (a spawned child imports it by name) and return
something picklable. Each rank runs on one thread: several ranks share this machine's few cores. On Linux the ranks
are forked from the test's process: a spawned rank would import torch and the test's module again, a second or more
each, and the test processes compute on one thread, so no OpenMP pool is there to break in a fork.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

DEFAULT_START = "fork" if sys.platform.startswith("linux") else "spawn"


def run_on_ranks(
    fn: Callable[..., Any], tmp_path: Path, *args: Any, world: int = 2, start_method: str = DEFAULT_START
) -> dict[int, Any]:
    """``{rank: fn(rank, world, *args)}``; a failure on any rank fails the call with that rank's traceback."""
    results = mp.Manager().dict()
    init_file = str(Path(tmp_path) / f"pg_init_{fn.__name__}")
    mp.start_processes(
        _rank_entry, args=(world, init_file, fn, args, results), nprocs=world, join=True, start_method=start_method
    )
    return dict(results)


def _rank_entry(rank: int, world: int, init_file: str, fn: Callable[..., Any], args: tuple, results) -> None:
    torch.set_num_threads(1)
    # A collective that one rank never joins fails the test after five minutes instead of hanging it.
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=timedelta(minutes=5)
    )
    try:
        results[rank] = fn(rank, world, *args)
    finally:
        dist.destroy_process_group()
