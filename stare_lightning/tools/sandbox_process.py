"""Running one sandboxed process under a wall-time limit, reading a bounded amount of its output.

The host reads stdout and stderr (one pipe, in order) and keeps at most ``max_chars`` characters of it; what comes
after is read and dropped, up to ``DRAIN_BYTES``, so a program that prints a little too much still finishes, and
one that prints more is killed (``RLIMIT_FSIZE`` does not bound a pipe, and the host must never hold 100 MB of
output). At the wall-time limit the process group is killed: in the bubblewrap sandbox that kills the outer
``bwrap``, whose ``--die-with-parent`` takes down the sandbox's pid namespace with everything in it; with
``rlimits_unsafe`` it kills the launcher, whose init dies with it. The call's cgroup (``cgroups.py``) or uid
sweep (``kill_uid``) then stops whatever is left.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["DRAIN_BYTES", "ProcessOutcome", "ProcessRunner", "kill_uid", "processes_of_uid"]

DRAIN_BYTES = 1 << 20  # output read (and dropped past the kept part) before a process is stopped
_POLL_SECONDS = 0.1


@dataclass(frozen=True)
class ProcessOutcome:
    output: str  # the first max_chars characters of stdout and stderr together
    truncated: bool  # more was printed than ``output`` holds
    returncode: int | None  # None when the process was killed by the host
    timed_out: bool  # killed at the wall-time limit
    flooded: bool  # killed for printing more than DRAIN_BYTES


def _exited(pid: int) -> bool:
    """Whether ``pid`` has exited, without reaping it (its process group stays addressable until then)."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


class ProcessRunner:
    """Runs processes with ``run`` from any number of threads; ``kill_all`` stops those still running."""

    def __init__(self) -> None:
        self._live: set[subprocess.Popen] = set()
        self._lock = threading.Lock()

    def run(
        self,
        argv: Sequence[str],
        *,
        env: dict[str, str],
        cwd: str,
        timeout: float,
        max_chars: int,
        pass_fds: Sequence[int] = (),
    ) -> ProcessOutcome:
        # A new session: the host can kill the process group; the environment is the sandbox's only.
        proc = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=cwd,
            start_new_session=True,
            close_fds=True,
            pass_fds=tuple(pass_fds),
        )
        with self._lock:
            self._live.add(proc)
        deadline = time.monotonic() + timeout
        try:
            kept, total, timed_out, flooded = self._read(proc, deadline, max_chars * 4 + 8)  # utf-8: <= 4 bytes
            if not (timed_out or flooded):
                timed_out = not self._wait_exit(proc, deadline)
            _kill_group(proc.pid)  # leftovers of the group (rlimits mode), before the leader is reaped
            returncode = proc.wait()
        finally:
            proc.stdout.close()
            with self._lock:
                self._live.discard(proc)
        text = kept.decode("utf-8", errors="replace")
        truncated = total > len(kept) or len(text) > max_chars
        return ProcessOutcome(
            output=text[:max_chars],
            truncated=truncated,
            returncode=None if (timed_out or flooded) else returncode,
            timed_out=timed_out,
            flooded=flooded,
        )

    @staticmethod
    def _read(proc: subprocess.Popen, deadline: float, keep_bytes: int) -> tuple[bytes, int, bool, bool]:
        """Read the pipe until EOF, the process's exit, the deadline or the flood limit.
        Returns (kept bytes, bytes read, timed out, flooded)."""
        fd, kept, total = proc.stdout.fileno(), bytearray(), 0
        poller = select.poll()
        poller.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return bytes(kept), total, True, False
            if poller.poll(min(remaining, _POLL_SECONDS) * 1000):
                chunk = os.read(fd, 65536)
                if not chunk:
                    return bytes(kept), total, False, False
                total += len(chunk)
                kept += chunk[: max(0, keep_bytes - len(kept))]
                if total > DRAIN_BYTES:
                    return bytes(kept), total, False, True
            elif _exited(proc.pid):  # exited, while a leftover child holds the pipe open and says nothing
                return bytes(kept), total, False, False

    @staticmethod
    def _wait_exit(proc: subprocess.Popen, deadline: float) -> bool:
        """After EOF: wait for the exit until the deadline (a program may close its output and go on)."""
        while not _exited(proc.pid):
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.005)
        return True

    def kill_all(self) -> None:
        with self._lock:
            live = list(self._live)
        for proc in live:
            _kill_group(proc.pid)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def kill_uid(uid: int, deadline_seconds: float = 2.0) -> bool:
    """Stop, then kill, every process of real uid ``uid`` (a sandbox's own uid); True when none is left.

    Killing one scan's processes does not end a fork bomb: the survivors fork into the freed slots. So the
    processes are first frozen (SIGSTOP) until a scan finds none still running, then all killed at once; the
    scan repeats until the uid has no live process left. A process in uninterruptible sleep (``D``, e.g. a
    ``vfork`` parent waiting for its child) cannot be stopped, but it cannot fork either: it counts as frozen,
    and SIGKILL reaches it. Zombies are dead already (no memory, no CPU): orphans are reaped by init, as slowly
    as it likes, so they are not waited for."""
    deadline = time.monotonic() + deadline_seconds
    while time.monotonic() < deadline:
        states = {pid: state for pid, state in processes_of_uid(uid).items() if state not in "ZX"}
        if not states:
            return True
        running = [pid for pid, state in states.items() if state not in "TtD"]
        signum = signal.SIGSTOP if running else signal.SIGKILL
        for pid in running or list(states):
            try:
                os.kill(pid, signum)
            except OSError:
                pass  # gone meanwhile
        time.sleep(0.002 if running else 0.01)
    return not any(state not in "ZX" for state in processes_of_uid(uid).values())


def processes_of_uid(uid: int) -> dict[int, str]:
    """pid -> state letter (R, S, T, Z, ...) of every process whose real uid is ``uid``."""
    found = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/status") as status:
                fields = dict(line.split(":", 1) for line in status if ":" in line)
            if int(fields["Uid"].split()[0]) == uid:
                found[int(entry.name)] = fields["State"].split()[0]
        except (OSError, KeyError, ValueError):
            continue  # gone meanwhile
    return found
