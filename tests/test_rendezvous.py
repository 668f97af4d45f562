"""Where a run's ranks meet (``trainer/rendezvous.py``): the first node of the trainer's own SLURM step, and one line
within the deadline when they do not meet."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from lightning.fabric.plugins.environments import SLURMEnvironment

from stare_lightning.trainer.rendezvous import TIMED_OUT, meeting_point
from tests.test_fit import FAST, run_cli
from tests.test_fsdp import _free_port

# A job on node1..node3 whose trainer step runs on node2 and node3 (scripts/slurm_servers.sh's shape).
SERVERS_JOB = {
    "SLURM_JOB_ID": "4242",
    "SLURM_JOB_NAME": "stare_lightning",
    "SLURM_NODELIST": "node[1-3]",
    "SLURM_NTASKS": "2",
    "SLURM_NTASKS_PER_NODE": "1",
    "SLURM_PROCID": "0",
    "SLURM_LOCALID": "0",
    "SLURM_NODEID": "0",
}


@pytest.fixture
def slurm_step(monkeypatch):
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    for name, value in SERVERS_JOB.items():
        monkeypatch.setenv(name, value)
    return monkeypatch


def test_ranks_meet_at_the_first_node_of_their_own_step(slurm_step):
    slurm_step.setenv("SLURM_STEP_NODELIST", "node[2-3]")
    point = meeting_point(SLURMEnvironment())
    assert point.address == "node2"
    assert "SLURM_STEP_NODELIST=node[2-3]" in point.address_source
    assert point.port == 15000 + 4242 and "SLURM_JOB_ID=4242" in point.port_source


def test_lightning_alone_would_send_them_to_the_jobs_first_node(slurm_step):
    """The control: without the step's node list, Lightning's choice is node1, where no rank runs."""
    assert SLURMEnvironment().main_address == "node1"
    assert meeting_point(SLURMEnvironment()).address == "node1"


def test_an_address_set_by_the_user_wins(slurm_step):
    slurm_step.setenv("SLURM_STEP_NODELIST", "node[2-3]")
    slurm_step.setenv("MASTER_ADDR", "10.0.0.7")
    point = meeting_point(SLURMEnvironment())
    assert point.address == "10.0.0.7" and "MASTER_ADDR=10.0.0.7 in the environment" in point.address_source


# One rank: imports first, then "ready", and on a line from its stdin the rendezvous under the deadline; once met, it
# outlives the deadline (a timer left running would end it) before it says "met".
_RANK = """
import sys, time, torch.distributed as dist
from lightning.fabric.plugins.environments import LightningEnvironment
from stare_lightning.trainer.rendezvous import rendezvous_deadline
deadline = float(sys.argv[2])
print("ready", flush=True)
sys.stdin.readline()
with rendezvous_deadline(LightningEnvironment(), 2, deadline):
    dist.init_process_group("gloo", rank=int(sys.argv[1]), world_size=2)
dist.barrier()
time.sleep(deadline + 1)
print("met")
"""


def _rank(rank: int, timeout: float, port: int) -> subprocess.Popen:
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "PATH": "/usr/bin:/bin"}
    command = [sys.executable, "-c", _RANK, str(rank), str(timeout)]
    pipes = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE, "stderr": subprocess.PIPE}
    return subprocess.Popen(command, env=env, text=True, **pipes)


@pytest.mark.slow
def test_a_rank_alone_gives_up_at_the_deadline_in_one_line():
    port = _free_port()
    started = time.monotonic()
    out, err = _rank(1, 3.0, port).communicate("go\n", timeout=120)
    took = time.monotonic() - started  # imports included
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and f"127.0.0.1:{port}" in lines[0] and "MASTER_ADDR=127.0.0.1" in lines[0], err
    assert "within 3 s" in lines[0] and "met" not in out
    assert took < 60


@pytest.mark.slow
def test_ranks_that_meet_within_the_deadline_go_on():
    """The control: both ranks present within the same deadline; they meet, and the deadline passes harmlessly."""
    port = _free_port()
    ranks = [_rank(rank, 5.0, port) for rank in (0, 1)]
    assert [rank.stdout.readline().strip() for rank in ranks] == ["ready", "ready"]  # both done importing
    for rank in ranks:
        rank.stdin.write("go\n")
        rank.stdin.flush()
    results = [rank.communicate(timeout=120) for rank in ranks]
    assert [rank.returncode for rank in ranks] == [0, 0], results
    assert [out.split() for out, _ in results] == [["met"], ["met"]]


@pytest.mark.slow
def test_a_fit_whose_rank_zero_never_comes_ends_with_the_address_and_status_124(tmp_path, model_cache, monkeypatch):
    """Through the command line: rank 1 of a two-node FSDP2 run, whose rank 0 never starts."""
    port = _free_port()
    for name, value in {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "NODE_RANK": "1",
        "LOCAL_RANK": "0",
    }.items():
        monkeypatch.setenv(name, value)
    launch = ["trainer=fsdp", "trainer.devices=1", "trainer.num_nodes=2", "trainer.accelerator=cpu"]
    args = ["fit", f"output_dir={tmp_path / 'run'}", *FAST, *launch, "trainer.strategy.rendezvous_timeout=5"]
    proc = run_cli(args, model_cache, cwd=tmp_path)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == TIMED_OUT, out[-3000:]
    assert f"did not meet at 127.0.0.1:{port}" in out and "trainer.strategy.rendezvous_timeout" in out
