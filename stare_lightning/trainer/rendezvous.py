"""Where the ranks of a run meet, and a deadline for meeting there.

Lightning's ``SLURMEnvironment`` takes the master address from ``SLURM_NODELIST``: the first node of the whole job.
When a job runs the trainer on some of its nodes only (``scripts/slurm_servers.sh``: rollout servers on the first
node), that node runs no rank, and every rank waits for it forever with no message. Under ``srun`` the nodes of the
trainer's own step are ``SLURM_STEP_NODELIST``; its first node hosts rank 0, so that is the address used here.

torch's rendezvous has no deadline short of the process group's timeout (which also bounds every later collective,
so it cannot be short), and says nothing while it waits. ``rendezvous_deadline`` ends the process with one line
naming the address, the port and where each came from when the ranks have not met in time.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from lightning.fabric.plugins.environments import ClusterEnvironment, SLURMEnvironment

# The exit status of a rendezvous that timed out (as `timeout` uses).
TIMED_OUT = 124


@dataclass(frozen=True)
class MeetingPoint:
    address: str
    address_source: str
    port: int
    port_source: str

    def describe(self) -> str:
        return f"{self.address}:{self.port} (address: {self.address_source}; port: {self.port_source})"


def meeting_point(environment: ClusterEnvironment) -> MeetingPoint:
    """The rank-0 address and port this process will connect to, choosing the SLURM step's first node (module
    docstring) when nothing else set ``MASTER_ADDR``; sets ``MASTER_ADDR`` accordingly."""
    address_source = port_source = None
    if "MASTER_ADDR" in os.environ:
        address_source = f"MASTER_ADDR={os.environ['MASTER_ADDR']} in the environment"
    elif isinstance(environment, SLURMEnvironment) and os.environ.get("SLURM_STEP_NODELIST"):
        step_nodes = os.environ["SLURM_STEP_NODELIST"]
        os.environ["MASTER_ADDR"] = SLURMEnvironment.resolve_root_node_address(step_nodes)
        address_source = f"the first node of this SLURM step, SLURM_STEP_NODELIST={step_nodes}"
    if "MASTER_PORT" in os.environ:
        port_source = f"MASTER_PORT={os.environ['MASTER_PORT']} in the environment"
    address, port = environment.main_address, environment.main_port  # Lightning's choice where none was set
    if address_source is None:
        address_source = f"{type(environment).__name__}'s default"
    if port_source is None:
        job = os.environ.get("SLURM_JOB_ID")
        from_job = isinstance(environment, SLURMEnvironment) and job
        port_source = f"derived from SLURM_JOB_ID={job}" if from_job else f"{type(environment).__name__}'s default"
    return MeetingPoint(address, address_source, port, port_source)


@contextmanager
def rendezvous_deadline(environment: ClusterEnvironment, world_size: int, timeout: float) -> Iterator[None]:
    """Run the body (the process group's initialisation); if it has not returned after ``timeout`` seconds, print
    one line naming the meeting point and end the process with status 124."""
    point = meeting_point(environment)
    if world_size <= 1:
        yield
        return

    def give_up() -> None:
        print(
            f"error: the {world_size} ranks of this run did not meet at {point.describe()} within {timeout:g} s "
            "(trainer.strategy.rendezvous_timeout): check that every rank started and that this address is a node "
            "running one of them, reachable from every node",
            file=sys.stderr,
            flush=True,
        )
        os._exit(TIMED_OUT)  # the waiting thread is inside torch's C++ connect loop: nothing else can stop it

    timer = threading.Timer(timeout, give_up)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
