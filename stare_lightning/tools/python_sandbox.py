"""The ``python`` tool: each call runs in a fresh, resource-limited process, isolated by bubblewrap by default.

Isolation (``isolation``):
- ``bubblewrap`` (default): the mount, network, pid, ipc and uts isolation of ``bubblewrap.py`` plus the resource
  limits. Checked at construction (a trivial call must work), with a ``RuntimeError`` saying how to install it.
- ``rlimits``: the resource limits, a scratch working directory, an empty environment and isolated mode only.
  Weaker, and only an opt-in: the code can read whatever files an unprivileged user can (as root, any file: the
  sandbox keeps the capability to read so that an interpreter under ``/root`` still works), open sockets and see
  the host's processes; what it writes in its directory is bounded per file, not in total.

In both, the launcher (``sandbox_program.LAUNCHER``) sets ``RLIMIT_CPU`` (``cpu_seconds``), ``RLIMIT_AS``
(``memory_mb``, per process), ``RLIMIT_FSIZE`` (``file_size_mb``), ``RLIMIT_NPROC`` (``max_processes``) and no core
files, then, when the trainer is root, gives up root for a uid of its own drawn at random per call: the kernel does
not apply ``RLIMIT_NPROC`` to root, and a uid of its own makes the count the call's processes only, so a fork bomb
stops at ``max_processes``. A call's processes may hold ``max_processes x memory_mb`` in all. The host enforces
``timeout_seconds`` of wall time (bwrap startup, replay and call together) and reads at most ``max_output_chars``.

The interpreter is the trainer's own (``sys.executable``) in isolated mode (``-I -B``), with site-packages:
the policy may import numpy or sympy, as ReTool-style sandboxes allow; the root file system is read-only anyway.

State (``persist_state``): each call is a fresh process that first replays the episode's earlier successful calls
silently (``sandbox_program.replay_program``); with ``persist_state=False`` calls are independent.
"""

from __future__ import annotations

import os
import secrets
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from stare_lightning.tools.base import ToolResult, compose_text
from stare_lightning.tools.bubblewrap import (
    BUBBLEWRAP_MISSING,
    CALL_DIR,
    WORK_DIR,
    bubblewrap_argv,
    bubblewrap_path,
    sandbox_env,
)
from stare_lightning.tools.sandbox_process import ProcessOutcome, ProcessRunner, kill_uid
from stare_lightning.tools.sandbox_program import LAUNCHER, replay_program

__all__ = ["ISOLATIONS", "PythonSandbox"]

ISOLATIONS = ("bubblewrap", "rlimits")
_UID_FLOOR = 100_000  # a sandbox uid is drawn above this, from the uids this container maps


def _uid_range() -> tuple[int, int]:
    """The uids a call may run as: the widest range this user namespace maps, above ``_UID_FLOOR`` where it can
    (away from real users, whose processes a sandbox uid could signal); (0, 0) when there is none to draw from."""
    try:
        rows = [tuple(map(int, line.split())) for line in Path("/proc/self/uid_map").read_text().splitlines()]
    except OSError:
        rows = []
    low, count = max(((row[0], row[2]) for row in rows), key=lambda r: r[1], default=(0, 65536))
    high = low + count - 2  # the last mapped uid is often the overflow uid (nobody)
    if high > _UID_FLOOR + 1000:
        return max(low + 1, _UID_FLOOR), high
    return ((low + high) // 2, high) if high > low + 1 else (0, 0)


class PythonSandbox:
    """The ``python`` tool (see the module docstring for the isolation it gives)."""

    name = "python"
    argument = "code"
    description = "Run Python code in a sandbox and return what it prints (stdout and stderr)."
    argument_description = "Python code to run; use print() to see values."

    def __init__(
        self,
        *,
        isolation: str = "bubblewrap",
        persist_state: bool = True,
        timeout_seconds: float = 5.0,
        cpu_seconds: int = 5,
        memory_mb: int = 1024,
        file_size_mb: int = 16,
        max_processes: int = 16,
        max_output_chars: int = 1024,
    ) -> None:
        if isolation not in ISOLATIONS:
            raise ValueError(f"isolation={isolation!r} is not allowed: choose one of {list(ISOLATIONS)}")
        for key, value in (("timeout_seconds", timeout_seconds), ("cpu_seconds", cpu_seconds),
                           ("memory_mb", memory_mb), ("file_size_mb", file_size_mb),
                           ("max_processes", max_processes), ("max_output_chars", max_output_chars)):  # fmt: skip
            if not value > 0:
                raise ValueError(f"{key}={value!r} is out of range: must be > 0")
        self.isolation, self.persist_state = isolation, persist_state
        self.timeout_seconds, self.cpu_seconds, self.memory_mb = float(timeout_seconds), int(cpu_seconds), memory_mb
        self.file_size_mb, self.max_processes, self.max_output_chars = file_size_mb, max_processes, max_output_chars
        self._runner = ProcessRunner()
        self._bwrap = bubblewrap_path() if isolation == "bubblewrap" else None
        if isolation == "bubblewrap" and self._bwrap is None:
            raise RuntimeError(BUBBLEWRAP_MISSING)
        self._root = os.geteuid() == 0
        self._uids = _uid_range()
        self._self_check()

    def _self_check(self) -> None:
        result = self.run("print(6 * 7)")
        if not (result.ok and result.text.strip() == "42"):
            hint = BUBBLEWRAP_MISSING.split(": ", 1)[1] if self.isolation == "bubblewrap" else ""
            raise RuntimeError(
                f"the {self.isolation} sandbox does not work here: a trivial call gave {result.text!r} "
                f"(ok={result.ok}). {hint}"
            )

    def run(self, call: str, *, history: Sequence[str] = ()) -> ToolResult:
        started = time.perf_counter()
        program = replay_program(call, history if self.persist_state else ())
        low, high = self._uids
        uid = low + secrets.randbelow(high - low + 1) if self._root and high else 0
        with tempfile.TemporaryDirectory(prefix="stare_sandbox_", ignore_cleanup_errors=True) as host_dir:
            Path(host_dir, "program.py").write_text(program, encoding="utf-8")
            os.chmod(host_dir, 0o711)  # the sandbox uid enters its scratch directory in rlimits mode
            argv, env, cwd = self._command(host_dir, uid)
            try:
                outcome = self._runner.run(
                    argv, env=env, cwd=cwd, timeout=self.timeout_seconds, max_chars=self.max_output_chars
                )
            finally:
                # Whatever the call left: processes that left the process group (rlimits), or the sandbox's pid
                # namespace still being torn down (bubblewrap). The call is over only when none is left.
                if uid:
                    kill_uid(uid)
        return self._result(outcome, time.perf_counter() - started)

    def _command(self, host_dir: str, uid: int) -> tuple[list[str], dict[str, str], str]:
        """(argv, environment, working directory) of one call."""
        limits = [str(self.cpu_seconds), str(self.memory_mb), str(self.file_size_mb), str(self.max_processes)]
        python = [sys.executable, "-I", "-B", "-c", LAUNCHER]
        if self.isolation == "bubblewrap":
            launcher = [*python, f"{CALL_DIR}/program.py", WORK_DIR, *limits, str(uid), "0"]
            scratch_mb = max(16, 4 * self.file_size_mb)
            return bubblewrap_argv(self._bwrap, host_dir, scratch_mb, launcher), sandbox_env(WORK_DIR), host_dir
        work = os.path.join(host_dir, "work")
        launcher = [*python, os.path.join(host_dir, "program.py"), work, *limits, str(uid), "1"]
        return launcher, sandbox_env(work), host_dir

    def _result(self, outcome: ProcessOutcome, seconds: float) -> ToolResult:
        """What the model reads: the output, and a last line saying why the call failed when it did."""
        code, note, timed_out = outcome.returncode, None, outcome.timed_out
        if outcome.timed_out:
            note = f"TimeoutError: the call exceeded {self.timeout_seconds:g} s of wall time and was stopped"
        elif code is not None and (code < 0 or (self.isolation == "bubblewrap" and code > 128)):
            number = -code if code < 0 else code - 128  # bwrap exits with 128 + the signal that killed the call
            timed_out = number == signal.SIGXCPU
            note = _signal_note(number, self.cpu_seconds)
        elif code and not outcome.output.strip():
            note = f"the process exited with status {code}"
        text = compose_text(outcome.output, note, self.max_output_chars, outcome.truncated)
        return ToolResult(text=text, ok=code == 0, seconds=seconds, timed_out=timed_out)

    def close(self) -> None:
        self._runner.kill_all()


def _signal_note(number: int, cpu_seconds: int) -> str:
    if number == signal.SIGXCPU:
        return f"TimeoutError: the call exceeded its CPU time limit of {cpu_seconds} s"
    if number == signal.SIGKILL:
        return "Killed: the call was stopped (a resource limit was exceeded)"
    try:
        name = signal.Signals(number).name
    except ValueError:
        name = f"signal {number}"
    return f"the process was killed by {name}"
