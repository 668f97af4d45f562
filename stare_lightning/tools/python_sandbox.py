"""The ``python`` tool: each call runs in a fresh, resource-limited process, isolated by bubblewrap by default.

Isolation (``isolation``):
- ``bubblewrap`` (default): the allowlisted mounts and the network, pid, ipc and uts namespaces of
  ``bubblewrap.py``, the seccomp filter of ``seccomp.py`` (no namespaces, mounts, tracing, eBPF, keyrings or
  io_uring; no socket but AF_UNIX and AF_INET), plus the limits below. Checked at construction (a trivial call
  must work), with a ``RuntimeError`` naming the cause: bubblewrap or libseccomp not installed (and how to install
  them), the interpreter missing inside the sandbox, or namespaces refused.
- ``rlimits_unsafe``: the limits below, and what the launcher (``sandbox_launcher.py``) can do without
  bubblewrap: as root, new mount, pid, network, ipc and uts namespaces (a private ``/tmp`` and ``/dev/shm``, no
  network, the home directories, the trainer's directories and the password hashes hidden) and the seccomp
  filter; otherwise the same inside a user namespace where the kernel allows one, else none of it. Even at best
  the code reads every other file its uid can read (data directories outside the hidden ones included): use it
  only for code you would run anyway.

In both, the launcher sets ``RLIMIT_CPU`` (``cpu_seconds``), ``RLIMIT_AS`` (``memory_mb``, per process),
``RLIMIT_FSIZE`` (``file_size_mb``), ``RLIMIT_NPROC`` (``max_processes``), ``RLIMIT_NOFILE``
(``MAX_OPEN_FILES``) and no core files, then, when the trainer is root, gives up root for a uid of its own drawn
per call (never one ``/etc/passwd`` or ``/etc/group`` names, nor one with a live process): the kernel does not apply
``RLIMIT_NPROC`` to root, and a uid of its own makes the count the call's processes only. Where cgroups are
writable (``cgroups.py``) each call also gets its own: ``memory_mb`` for the call's total (shared memory and
memfds included), ``max_processes`` tasks (plus the sandbox's own few), one CPU. The host enforces
``timeout_seconds`` of wall time (start-up, replay and call together) and reads at most ``max_output_chars``.

A call ends only when none of its processes is left: its cgroup is killed, else its uid swept (``kill_uid``);
with ``rlimits_unsafe`` the pid namespace ends with the call's init. A call that leaves a process that cannot be
stopped fails, whatever its output.

The interpreter is the trainer's own, by its real path (``bubblewrap.sandbox_python``), in isolated mode
(``-I -B``), with site-packages: the policy may import numpy or sympy, as ReTool-style sandboxes allow; the file
system it sees is read-only.

State (``persist_state``): each call is a fresh process that first replays the episode's earlier successful calls
silently (``sandbox_program.replay_program``); with ``persist_state=False`` calls are independent.
"""

from __future__ import annotations

import json
import os
import re
import signal
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from stare_lightning.tools.base import ToolResult, compose_text
from stare_lightning.tools.bubblewrap import (
    BUBBLEWRAP_MISSING,
    CALL_DIR,
    SECRETS,
    WORK_DIR,
    bubblewrap_argv,
    bubblewrap_path,
    runtime_dirs,
    sandbox_env,
    sandbox_python,
)
from stare_lightning.tools.cgroups import CallCgroup, CgroupSetup, join_argv
from stare_lightning.tools.sandbox_process import ProcessOutcome, ProcessRunner, kill_uid
from stare_lightning.tools.sandbox_program import PythonToolSpec, replay_program
from stare_lightning.tools.sandbox_uids import SandboxUids
from stare_lightning.tools.seccomp import filter_for_this_machine

__all__ = ["ISOLATIONS", "MAX_OPEN_FILES", "PythonSandbox", "unsafe_hidden_dirs"]

ISOLATIONS = ("bubblewrap", "rlimits_unsafe")
RLIMITS_RENAMED = (
    "isolation='rlimits' was renamed to 'rlimits_unsafe': it is weaker than bubblewrap (the code can read the "
    "host's files outside the home directories, and without root or user namespaces also reach its network, "
    "processes and /tmp); set isolation='rlimits_unsafe' to accept that, or use bubblewrap"
)
MAX_OPEN_FILES = 256  # RLIMIT_NOFILE of a call's processes
CPUS_PER_CALL = 1.0  # the cgroup's CPU quota
_SANDBOX_TASKS = 4  # tasks of the sandbox itself in a call's cgroup: the join shell / bwrap, its init, launcher
_LAUNCHER = Path(__file__).with_name("sandbox_launcher.py").read_text(encoding="utf-8")
# Hidden by rlimits_unsafe's mount namespace (with the trainer's working directory, home and checkout).
_UNSAFE_HIDDEN = ("/root", "/home", "/run", "/var/tmp", "/mnt", "/media", "/srv")
_SYSTEM = ("/usr", "/lib", "/lib32", "/lib64", "/libx32", "/bin", "/sbin", "/etc", "/proc", "/sys", "/dev", "/tmp")


def _inside(path: str, parent: str) -> bool:
    return path == parent or path.startswith(parent.rstrip("/") + "/")


def unsafe_hidden_dirs() -> list[str]:
    """The directories ``rlimits_unsafe`` hides, outermost only, never the system's."""
    checkout = Path(__file__).resolve().parents[2]
    candidates = [*_UNSAFE_HIDDEN, os.getcwd(), os.path.expanduser("~"), str(checkout)]
    real = {os.path.realpath(c) for c in candidates if c and os.path.isdir(c)}
    kept = [p for p in real if p != "/" and not any(_inside(p, s) or _inside(s, p) for s in _SYSTEM)]
    return sorted(p for p in kept if not any(q != p and _inside(p, q) for q in kept))


class PythonSandbox(PythonToolSpec):
    """The ``python`` tool (see the module docstring for the isolation it gives)."""

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
        if isolation == "rlimits":
            raise ValueError(RLIMITS_RENAMED)
        if isolation not in ISOLATIONS:
            raise ValueError(f"isolation={isolation!r} is not allowed: choose one of {list(ISOLATIONS)}")
        for key, value in (
            ("timeout_seconds", timeout_seconds),
            ("cpu_seconds", cpu_seconds),
            ("memory_mb", memory_mb),
            ("file_size_mb", file_size_mb),
            ("max_processes", max_processes),
            ("max_output_chars", max_output_chars),
        ):
            if not value > 0:
                raise ValueError(f"{key}={value!r} is out of range: must be > 0")
        self.isolation, self.persist_state = isolation, persist_state
        self.timeout_seconds, self.cpu_seconds, self.memory_mb = float(timeout_seconds), int(cpu_seconds), memory_mb
        self.file_size_mb, self.max_processes, self.max_output_chars = file_size_mb, max_processes, max_output_chars
        self._runner = ProcessRunner()
        self._bwrap = bubblewrap_path() if isolation == "bubblewrap" else None
        if isolation == "bubblewrap" and self._bwrap is None:
            raise RuntimeError(BUBBLEWRAP_MISSING)
        self._uids = SandboxUids.for_this_process()
        self._cgroups = CgroupSetup.for_this_process()
        self._seccomp = filter_for_this_machine()  # SeccompUnavailable saying why, and how to install libseccomp
        self._self_check()

    def _self_check(self) -> None:
        result = self.run("print(6 * 7)")
        if not (result.ok and result.text.strip() == "42"):
            raise RuntimeError(_self_check_failure(self.isolation, result.text))

    def run(self, call: str, *, history: Sequence[str] = ()) -> ToolResult:
        started = time.perf_counter()
        program = replay_program(call, history if self.persist_state else ())
        uid = self._uids.draw()
        try:
            with tempfile.TemporaryDirectory(prefix="stare_sandbox_", ignore_cleanup_errors=True) as host_dir:
                Path(host_dir, "program.py").write_text(program, encoding="utf-8")
                os.chmod(host_dir, 0o711)  # the sandbox uid enters it (rlimits_unsafe without namespaces)
                outcome, stopped, memory_exhausted = self._run_program(host_dir, uid)
        finally:
            self._uids.release(uid)
        return self._result(outcome, time.perf_counter() - started, stopped, memory_exhausted)

    def _run_program(self, host_dir: str, uid: int) -> tuple[ProcessOutcome, bool, bool]:
        """(outcome, whether every process of the call is gone, whether the call ran out of memory)."""
        cgroup = None
        if self._cgroups is not None:
            cgroup = self._cgroups.create(
                memory_bytes=self.memory_mb << 20, cpus=CPUS_PER_CALL, max_tasks=self.max_processes + _SANDBOX_TASKS
            )
        seccomp_fd = None
        if self.isolation == "bubblewrap":
            seccomp_fd = os.memfd_create("stare_seccomp")  # bwrap reads the filter from this descriptor
            os.write(seccomp_fd, self._seccomp)
            os.lseek(seccomp_fd, 0, os.SEEK_SET)
        else:
            Path(host_dir, "seccomp.bpf").write_bytes(self._seccomp)
        try:
            argv, env = self._command(host_dir, uid, seccomp_fd)
            outcome = self._runner.run(
                join_argv(cgroup.procs_files, argv) if cgroup else argv,
                env=env,
                cwd="/",
                timeout=self.timeout_seconds,
                max_chars=self.max_output_chars,
                pass_fds=() if seccomp_fd is None else (seccomp_fd,),
            )
        finally:
            # Whatever the call left: processes that left its session, or a namespace still being torn down.
            stopped = self._stop_leftovers(cgroup, uid)
            memory_exhausted = cgroup is not None and cgroup.memory_exhausted()
            if seccomp_fd is not None:
                os.close(seccomp_fd)
            if cgroup is not None:
                cgroup.remove()
        return outcome, stopped, memory_exhausted

    @staticmethod
    def _stop_leftovers(cgroup: CallCgroup | None, uid: int) -> bool:
        """Kill every process of the call: by its cgroup where it has one with a kill, else by its uid."""
        if cgroup is not None and "kill" in cgroup.roles:
            return cgroup.kill()
        stopped = cgroup.kill() if cgroup is not None else True
        return kill_uid(uid) and stopped if uid else stopped

    def _command(self, host_dir: str, uid: int, seccomp_fd: int | None) -> tuple[list[str], dict[str, str]]:
        """(argv, environment) of one call."""
        settings = {
            "uid": uid,
            "cpu_seconds": self.cpu_seconds,
            "memory_mb": self.memory_mb,
            "file_size_mb": self.file_size_mb,
            "max_processes": self.max_processes,
            "max_open_files": MAX_OPEN_FILES,
            "workdir": WORK_DIR,
        }
        scratch_mb = max(16, 4 * self.file_size_mb)
        if self.isolation == "bubblewrap":
            settings.update(mode="bubblewrap", program=f"{CALL_DIR}/program.py")
            launcher = [sandbox_python(), "-I", "-B", "-c", _LAUNCHER, json.dumps(settings)]
            return bubblewrap_argv(self._bwrap, host_dir, scratch_mb, launcher, seccomp_fd), sandbox_env(WORK_DIR)
        settings.update(
            mode="rlimits_unsafe",
            program=os.path.join(host_dir, "program.py"),
            host_workdir=os.path.join(host_dir, "work"),
            seccomp=os.path.join(host_dir, "seccomp.bpf"),
            scratch_mb=scratch_mb,
            hidden=unsafe_hidden_dirs(),
            runtime=runtime_dirs(),
            secrets=list(SECRETS),
        )
        # By its real path too: the launcher's mounts may hide a symlink the interpreter was started through.
        launcher = [sandbox_python(), "-I", "-B", "-c", _LAUNCHER, json.dumps(settings)]
        return launcher, sandbox_env(WORK_DIR)

    def _result(self, outcome: ProcessOutcome, seconds: float, stopped: bool, memory_exhausted: bool) -> ToolResult:
        """What the model reads: the output, and a last line saying why the call failed when it did."""
        code, note, timed_out = outcome.returncode, None, outcome.timed_out
        if outcome.timed_out:
            note = f"TimeoutError: the call exceeded {self.timeout_seconds:g} s of wall time and was stopped"
        elif memory_exhausted:
            note = f"MemoryError: the call exceeded its memory limit of {self.memory_mb} MB and was stopped"
        elif code is not None and (code < 0 or code > 128):
            number = -code if code < 0 else code - 128  # the sandbox exits with 128 + the signal that killed the call
            timed_out = number == signal.SIGXCPU
            note = _signal_note(number, self.cpu_seconds)
        elif code and not outcome.output.strip():
            note = f"the process exited with status {code}"
        if not stopped:
            note = "the call left a process running that could not be stopped" + (f"; {note}" if note else "")
        text = compose_text(outcome.output, note, self.max_output_chars, outcome.truncated)
        ok = code == 0 and stopped and not memory_exhausted
        return ToolResult(text=text, ok=ok, seconds=seconds, timed_out=timed_out)

    def close(self) -> None:
        self._runner.kill_all()


def _self_check_failure(isolation: str, output: str) -> str:
    """Why a trivial call failed, from what it printed: bubblewrap is installed (``BUBBLEWRAP_MISSING`` is for
    when it is not), so the cause is a path missing inside the sandbox, a namespace refused, or the runtime."""
    said = f"the {isolation} sandbox does not work here: a trivial call gave {output.strip()!r}"
    missing = re.search(r"bwrap: execvp (.+): No such file or directory", output)
    if missing:
        return (
            f"{said}. The interpreter {missing.group(1)} is not inside the sandbox, which binds read-only the "
            f"system directories and the Python runtime at {runtime_dirs()} (each by its real path); start the "
            "trainer with an interpreter inside those, e.g. the virtual environment's own bin/python"
        )
    if output.startswith("bwrap:"):
        needs = (
            "a container that allows it namespaces and mounts (docker: a seccomp and AppArmor profile that allow "
            "unshare and mount, or --privileged)"
            if os.geteuid() == 0
            else "unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1; on Ubuntu 24.04 also "
            "kernel.apparmor_restrict_unprivileged_userns=0) or a root trainer"
        )
        return (
            f"{said}. bubblewrap is installed but could not set the sandbox up: it needs {needs}; "
            "tools.isolation=rlimits_unsafe is the weaker fallback"
        )
    return said


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
