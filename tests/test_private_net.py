"""A launched server's engine ports against another local user (``rollout/server/trainer_side/private_net.py``), on
a torch gloo process group as vLLM's worker opens them: on the host's network a connect-and-close flood by another
user kills the process (``accept: Too many open files``, the control: what a server's worker did); in the private
network namespace the launcher gives a server on a Unix socket, the same flood reaches nothing and the group keeps
working. The real server's case is in tests/test_lora_sync.py (its worker's ports, flooded)."""

from __future__ import annotations

import subprocess
import sys

from tests.engine_ports import FLOOD, listening_ports, network_namespace, ports_listened_on_here

# A gloo group as a vLLM worker has them, with a low descriptor limit so that the leak shows in a few hundred
# connections; it reports "ready", then works the group until stopped, and says so on stdin's end.
_GLOO = """
import resource, sys, tempfile, time
resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
import torch, torch.distributed as dist
dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
group = dist.new_group(backend="gloo")
print("ready", flush=True)
sys.stdin.readline()
total = torch.ones(1)
dist.all_reduce(total, group=group)
print("alive", float(total), flush=True)
dist.destroy_process_group()  # gloo's threads left running at exit may abort the interpreter ("terminate called")
"""


def _gloo(private: bool) -> subprocess.Popen:
    from stare_lightning.rollout.server.trainer_side import private_net

    process = subprocess.Popen(
        [sys.executable, "-c", _GLOO],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=(lambda: private_net.enter()) if private else None,
    )
    assert process.stdout.readline().strip() == "ready", process.stderr.read()[-2000:]
    return process


def _flood_then_finish(process: subprocess.Popen, other_user) -> tuple[dict, int, str]:
    # In a private namespace, a port number that some other process on the host listens on too (another test's
    # engine, say) would answer the flood for reasons of its own: only ports free on the host are flooded there.
    taken = ports_listened_on_here() if network_namespace(process.pid) != network_namespace("self") else set()
    ports = [port for port in listening_ports(process.pid) if port[1] not in taken]
    assert ports, "a gloo group listens on TCP"
    flood = other_user.run(FLOOD.format(ports=ports, rounds=1000), timeout=120)
    out, err = process.communicate("\n", timeout=60)
    return flood, process.returncode, out + err


def test_a_connect_flood_by_another_user_kills_gloo_on_the_host_network_and_reaches_nothing_in_a_private_one(
    other_user,
):
    from stare_lightning.rollout.server.trainer_side import private_net

    assert private_net.available() is None, private_net.available()
    # The control: on the host's network every connection lands, and the leaked descriptors end the process.
    flood, code, output = _flood_then_finish(_gloo(private=False), other_user)
    assert flood["connected"] > 200
    # gloo's accept thread throws; when two of its threads throw at once the runtime aborts before printing why.
    died = "Too many open files" in output or "terminate called after throwing an instance of 'gloo::" in output
    assert code != 0 and died, output[-2000:]
    # In a private namespace the same ports on the host's loopback are someone else's or no one's: nothing lands.
    process = _gloo(private=True)
    assert network_namespace(process.pid) != network_namespace("self")
    flood, code, output = _flood_then_finish(process, other_user)
    assert flood["connected"] == 0 and flood["refused"] > 0
    assert code == 0 and "alive 1.0" in output, output[-2000:]


def _low_limit(then_raise: bool):
    import resource

    from stare_lightning.rollout.server.trainer_side import private_net

    def run() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
        if then_raise:
            private_net.raise_descriptor_limit()

    return run


def test_the_descriptor_limit_is_raised_to_the_hard_one():
    """Where no private namespace can be made, a server may at least open all the descriptors it is allowed."""
    probe = "import resource; print(*resource.getrlimit(resource.RLIMIT_NOFILE))"
    limits = [
        subprocess.run(
            [sys.executable, "-c", probe], capture_output=True, text=True, check=True, preexec_fn=preexec
        ).stdout.split()
        for preexec in (_low_limit(False), _low_limit(True))
    ]
    hard = limits[0][1]
    assert limits == [["64", hard], [hard, hard]] and int(hard) > 64  # the control first: the low limit inherited
