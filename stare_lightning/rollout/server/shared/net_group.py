"""The process group of one network weight push: the trainer's rank 0 (rank 0 here) and one server's worker (rank
1), built from a ``TCPStore`` the trainer hosts and a gloo group of their own, never the trainer's default group.

The group's keys lie under a prefix derived from the run's secret (``net_wire.rendezvous_prefix``), so a process
that reaches the store without the secret never finds the trainer. Gloo sends over TCP between the two hosts' own
addresses; both sides give each send and receive the run's request timeout, so a peer that is gone or a cut link
ends the push with an error, never a hang.
"""

from __future__ import annotations

import socket
from datetime import timedelta

import torch
from torch.distributed import PrefixStore, ProcessGroupGloo, TCPStore

__all__ = ["GROUP_SIZE", "TransferGroup", "connect_store", "host_store", "route_address"]

GROUP_SIZE = 2  # the trainer and one server's worker
TRAINER_RANK, WORKER_RANK = 0, 1


def host_store(address: str, port: int, timeout: float) -> TCPStore:
    """The trainer's rendezvous store, listening on ``port`` (0: a free one, read back as ``store.port``)."""
    return TCPStore(address, port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout))


def connect_store(address: str, port: int, timeout: float) -> TCPStore:
    """A worker's client of the trainer's store."""
    return TCPStore(address, port, is_master=False, timeout=timedelta(seconds=timeout))


def route_address(host: str) -> str:
    """This host's address on the route to ``host`` (the source address the kernel picks; nothing is sent)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((host, 9))
        return probe.getsockname()[0]


class TransferGroup:
    """One side of a two-process gloo group under ``prefix`` in ``store``; ``local_address`` is the address this
    side's gloo listens on (one the peer can reach). Joining blocks until the peer joins, or ``timeout`` passes."""

    def __init__(self, store: TCPStore, prefix: str, rank: int, local_address: str, timeout: float) -> None:
        options = ProcessGroupGloo._Options()
        options._timeout = timedelta(seconds=timeout)
        options._devices = [ProcessGroupGloo.create_device(hostname=local_address)]
        self.rank, self.timeout = rank, timedelta(seconds=timeout)
        self._group = ProcessGroupGloo(PrefixStore(prefix, store), rank, GROUP_SIZE, options)

    def send(self, buffer: torch.Tensor) -> None:
        """The trainer's side: ``buffer`` (uint8, contiguous, on the CPU) to the worker."""
        self._group.send([buffer], WORKER_RANK, 0).wait(self.timeout)

    def receive(self, buffer: torch.Tensor) -> None:
        """The worker's side: fill ``buffer`` with what the trainer sends."""
        self._group.recv([buffer], TRAINER_RANK, 0).wait(self.timeout)
