"""A SLURM cluster on this machine for one test module (``scripts/cluster.sh``): nodes are network, UTS and mount
namespaces with private ``/tmp`` and ``/dev/shm``, so what a job writes there stays on its node, as on real hosts.

Jobs see the rest of the file system. They run in ``Cluster.shared`` (outside ``/tmp``), and the built models they
need are copied there from the test session's model cache, which lies under ``/tmp``.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tests.needs import require

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "cluster.sh"


@dataclass(frozen=True)
class Job:
    id: str
    state: str
    nodes: str
    output: str


@dataclass
class Cluster:
    name: str
    subnet: str
    directory: Path

    @property
    def shared(self) -> Path:
        return self.directory / "shared"

    @property
    def env(self) -> dict[str, str]:
        """The variables a job runs with: SLURM's commands pointed here, this interpreter, one thread a rank."""
        return {
            **os.environ,
            "SLURM_CONF": str(self.directory / "slurm.conf"),
            "STARE_LIGHTNING_CACHE": str(self.shared / "cache"),
            "PYTHON": sys.executable,
            "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": "1",
        }

    def script(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["bash", str(SCRIPT), *args], env=self._script_env(), capture_output=True, text=True, check=check
        )

    def _script_env(self) -> dict[str, str]:
        names = {"STARE_CLUSTER_NAME": self.name, "STARE_CLUSTER_SUBNET": self.subnet}
        return {**os.environ, **names, "STARE_CLUSTER_DIR": str(self.directory)}

    def popen(self, host: str, *command: str, env: dict[str, str] | None = None) -> subprocess.Popen:
        """``command`` on ``host``, its stdin and stdout piped (text)."""
        pipes = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE, "stderr": subprocess.STDOUT}
        full_env = {**self._script_env(), **(env or {})}
        return subprocess.Popen(["bash", str(SCRIPT), "run", host, *command], env=full_env, text=True, **pipes)

    def pids(self, host: str, command_part: str) -> list[int]:
        """The processes on ``host`` whose command line holds ``command_part``."""
        found = []
        for pid in map(int, self.script("pids", host).stdout.split()):
            try:
                if command_part in Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode():
                    found.append(pid)
            except FileNotFoundError:
                pass  # ended meanwhile
        return found

    def kill(self, host: str, command_part: str, sig: int = signal.SIGKILL) -> int:
        """Signal (``sig``) the processes on ``host`` whose command line holds ``command_part``; how many there were."""
        return signal_each(self.pids(host, command_part), sig)

    def copy_models(self, model_cache: str) -> None:
        """The built tiny models (and their cold starts) of the session's cache, where the nodes can read them."""
        target = self.shared / "cache"
        target.mkdir(exist_ok=True)
        for entry in Path(model_cache).glob("tiny*"):
            if entry.is_dir() and not (target / entry.name).exists():
                shutil.copytree(entry, target / entry.name)

    def sbatch(self, *args: str, cwd: Path, env: dict[str, str] | None = None, timeout: float = 900) -> Job:
        """Submit a job, wait for it to leave the queue, and return its final state, nodes and output."""
        return self.wait(self.submit(*args, cwd=cwd, env=env), cwd, timeout)

    def submit(self, *args: str, cwd: Path, env: dict[str, str] | None = None) -> str:
        command = ["sbatch", "--parsable", "-o", "slurm-%j.out", *args]
        out = subprocess.run(command, cwd=cwd, env={**self.env, **(env or {})}, capture_output=True, text=True)
        assert out.returncode == 0, f"sbatch refused the job: {out.stderr}"
        return out.stdout.strip().split(";")[0]

    def wait(self, job_id: str, cwd: Path, timeout: float = 900) -> Job:
        deadline = time.time() + timeout
        while (job := self.job(job_id, cwd)).state in ACTIVE_STATES:
            if time.time() > deadline:
                subprocess.run(["scancel", job_id], env=self.env, check=False)
                raise TimeoutError(f"job {job_id} still {job.state} after {timeout} s: {job.output[-4000:]}")
            time.sleep(1)
        return job

    def active(self, job_id: str, cwd: Path) -> bool:
        """The job is queued or under way: not yet in a final state."""
        return self.job(job_id, cwd).state in ACTIVE_STATES

    def job(self, job_id: str, cwd: Path) -> Job:
        shown = subprocess.run(["scontrol", "show", "job", job_id], env=self.env, capture_output=True, text=True)
        fields = dict(re.findall(r"\b(JobState|NodeList)=(\S+)", shown.stdout))
        output = cwd / f"slurm-{job_id}.out"
        text = output.read_text() if output.exists() else ""
        return Job(job_id, fields.get("JobState", "UNKNOWN"), fields.get("NodeList", ""), text)


# A job's states before its final one. CONFIGURING comes between PENDING and RUNNING while its nodes are readied: a
# poll that took only PENDING and RUNNING for "under way" saw a job just started as over.
ACTIVE_STATES = ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING")


@contextmanager
def slurm_cluster(role: str, index: int, nodes: int) -> Iterator[Cluster]:
    """Nodes ``node1..node<nodes>`` up for the body, then every process, namespace and link gone. The cluster's name
    and subnet come from this process and ``index`` (one per test module), so test sessions running side by side on
    one machine, and a module's cluster beside another's, never share a bridge or a namespace."""
    require("slurm")
    pid = os.getpid()
    name, subnet = f"{role[:2]}{pid % 100000}", f"10.{100 + pid % 150}.{index}"
    cluster = Cluster(name=name, subnet=subnet, directory=Path("/var/tmp") / f"stare-cluster-{name}")
    try:
        up = cluster.script("up", str(nodes), check=False)
        assert up.returncode == 0, f"scripts/cluster.sh up failed: {up.stderr}"
        yield cluster
    finally:
        cluster.script("down", check=False)
        shutil.rmtree(cluster.directory, ignore_errors=True)


def signal_each(pids: list[int], sig: int) -> int:
    """Signal each process still there; how many were."""
    signalled = 0
    for pid in pids:
        try:
            os.kill(pid, sig)
            signalled += 1
        except ProcessLookupError:
            pass  # ended meanwhile
    return signalled
