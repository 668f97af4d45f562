"""The verifier worker's pid namespace from the inside out: pid 1 is the worker, a supervisor outside reaps it.

``unshare(CLONE_NEWPID)`` (done in ``confinement.confine``) leaves the caller where it was; its next child is pid 1
of the new namespace. ``become_namespace_init`` forks that child, which returns and goes on to be the worker, and
turns the process the pool started into its supervisor: it keeps no descriptor but its end of one pipe (so the
worker's socket closes when the worker does), waits, and exits with the worker's status. Asked to stop (SIGTERM,
what the pool sends first) it kills the worker and reaps it, so no zombie is left for the host's init to collect;
killed outright (SIGKILL) it takes the worker down through the worker's parent-death signal
(``die_with_supervisor``), and with pid 1 gone the kernel kills whatever else is left in the namespace.
"""

from __future__ import annotations

import ctypes
import os
import select
import signal

__all__ = ["become_namespace_init", "die_with_supervisor"]

_PR_SET_PDEATHSIG = 1
_libc = ctypes.CDLL(None, use_errno=True)


def become_namespace_init() -> int:
    """Fork into the new pid namespace. Returns, in the child only (pid 1 there), the read end of a pipe whose write
    end only the supervisor holds; the parent supervises and never returns."""
    supervisor_alive, held_by_supervisor = os.pipe()
    child = os.fork()
    if child == 0:
        os.close(held_by_supervisor)
        return supervisor_alive
    os.close(supervisor_alive)
    os.closerange(3, held_by_supervisor)
    os.closerange(held_by_supervisor + 1, os.sysconf("SC_OPEN_MAX"))
    _supervise(child)
    raise AssertionError("unreachable: the supervisor exits in _supervise")


def _supervise(child: int) -> None:
    """The supervisor's whole life: wait for the worker, then exit with its status (never returns)."""

    def stop(_signum, _frame):
        try:
            os.kill(child, signal.SIGKILL)
            os.waitpid(child, 0)
        except (ProcessLookupError, ChildProcessError):
            pass  # already reaped below
        os._exit(128 + signal.SIGTERM)

    signal.signal(signal.SIGTERM, stop)
    _, status = os.waitpid(child, 0)
    code = os.waitstatus_to_exitcode(status)
    os._exit(code if code >= 0 else 128 - code)


def die_with_supervisor(supervisor_alive: int) -> None:
    """SIGKILL this process when its supervisor dies. Call it after the last change of credentials (which clears
    the parent-death signal); the pipe then tells whether the supervisor died before it was set: its end closes
    with it."""
    if _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"prctl(PR_SET_PDEATHSIG): {os.strerror(errno)}")
    if select.select([supervisor_alive], [], [], 0)[0]:
        os._exit(1)
    os.close(supervisor_alive)
