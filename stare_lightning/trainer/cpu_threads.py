"""Threads for several CPU ranks on one machine."""

from __future__ import annotations

import os

import torch


def share_cores(world_size: int, ranks_on_this_machine: int) -> None:
    """Give each rank its share of the machine's cores when several ranks run on CPUs.

    Without it OpenMP's spinning threads of each rank fight the others' and every step slows down many times
    over. An explicit ``OMP_NUM_THREADS`` wins: launchers such as torchrun set it, and only they know how many
    ranks share the machine.
    """
    if world_size > 1 and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(ranks_on_this_machine, 1)))
