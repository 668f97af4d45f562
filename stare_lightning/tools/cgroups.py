"""One cgroup per sandboxed call: the call's total memory (shared memory and memfds included, which the address-space
limit does not see), its number of tasks and its CPU share, and a kill that leaves none of its processes behind.

cgroup v2 is used where this process may create child cgroups and the controllers are enabled for them
(``memory.max``, ``pids.max``, ``cpu.max``, ``cgroup.kill``); cgroup v1 otherwise (``memory.limit_in_bytes``,
``pids.max``, ``cpu.cfs_quota_us``, and the freezer: freeze, SIGKILL every task, thaw). Both may be mixed on a
hybrid host (the limits from v1, the kill from v2). Without any, ``CgroupSetup.detect`` returns None and the
sandbox keeps only its per-process limits (a log warning says so once).

A call's processes join its cgroups before the call's program starts: ``join_argv`` wraps the command in a shell
that writes its own pid into each ``cgroup.procs`` and then executes the command, so nothing runs outside them.
"""

from __future__ import annotations

import functools
import logging
import os
import secrets
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["CallCgroup", "CgroupSetup", "join_argv"]

logger = logging.getLogger(__name__)
_V1_CONTROLLERS = ("memory", "pids", "cpu", "freezer")
_CPU_PERIOD_US = 100_000
_JOIN_SCRIPT = (
    'n=$1; shift; while [ "$n" -gt 0 ]; do '
    'echo $$ > "$1" || { echo "sandbox: could not join the cgroup $1" >&2; exit 125; }; '
    'shift; n=$((n - 1)); done; exec "$@"'
)


def join_argv(procs_files: list[str], argv: list[str]) -> list[str]:
    """``argv`` run by a shell that first joins the cgroups whose ``cgroup.procs`` files are given."""
    if not procs_files:
        return list(argv)
    return ["/bin/sh", "-c", _JOIN_SCRIPT, "sandbox-join", str(len(procs_files)), *procs_files, *argv]


def _write(path: Path, value: str) -> None:
    path.write_text(value)


def _mounts() -> list[tuple[str, str, str, set[str]]]:
    """(mount point, root inside the hierarchy, file system type, super options) of each cgroup mount."""
    found = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        before, _, after = line.partition(" - ")
        fields, tail = before.split(), after.split()
        if len(tail) >= 3 and tail[0] in ("cgroup", "cgroup2"):
            found.append((fields[4].replace("\\040", " "), fields[3], tail[0], set(tail[2].split(","))))
    return found


def _own_paths() -> dict[str, str]:
    """Controller (or "" for cgroup v2) -> this process's cgroup path, from /proc/self/cgroup."""
    paths = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        for controller in controllers.split(",") if controllers else [""]:
            paths[controller] = path
    return paths


def _own_dir(mount_point: str, mount_root: str, path: str) -> Path | None:
    """This process's cgroup directory under a mount (None when the mount does not show it)."""
    if mount_root != "/" and not (path == mount_root or path.startswith(mount_root + "/")):
        return None
    relative = path[len(mount_root) :] if mount_root != "/" else path
    directory = Path(mount_point + relative.rstrip("/")) if relative.strip("/") else Path(mount_point)
    return directory if directory.is_dir() and os.access(directory, os.W_OK) else None


def _v2_kill_works(base: Path) -> bool:
    """Whether a child of ``base`` can be made and has ``cgroup.kill`` (Linux >= 5.14)."""
    probe = base / f"stare_probe_{os.getpid()}_{secrets.token_hex(4)}"
    try:
        probe.mkdir()
    except OSError:
        return False
    try:
        return (probe / "cgroup.kill").exists()
    finally:
        probe.rmdir()


def _v2_controllers(base: Path) -> set[str]:
    """The controllers a child of ``base`` gets: those already enabled for its children, else those it could
    enable (refused when ``base`` holds processes itself, unless it is a root)."""
    wanted = {"memory", "pids", "cpu"}
    try:
        enabled = set((base / "cgroup.subtree_control").read_text().split())
        available = set((base / "cgroup.controllers").read_text().split())
    except OSError:
        return set()
    missing = (wanted & available) - enabled
    if missing:
        try:
            _write(base / "cgroup.subtree_control", " ".join(f"+{c}" for c in sorted(missing)))
            enabled |= missing
        except OSError:
            pass
    return wanted & enabled


@dataclass(frozen=True)
class CgroupSetup:
    """Where the call cgroups are made: a base directory per role (memory, pids, cpu: the limits; kill: v2's
    cgroup.kill or v1's freezer), each with its cgroup version."""

    bases: dict[str, tuple[int, Path]]

    @classmethod
    @functools.cache
    def for_this_process(cls) -> CgroupSetup | None:
        """``detect()``, once per process (it warns about what is missing)."""
        return cls.detect()

    @classmethod
    def detect(cls) -> CgroupSetup | None:
        """The roles this process can give its calls; None when it can give none (warned once)."""
        try:
            mounts, own = _mounts(), _own_paths()
        except OSError:
            mounts, own = [], {}
        bases: dict[str, tuple[int, Path]] = {}
        for point, root, kind, _options in mounts:  # cgroup v2 first: one tree for every role it has
            if kind == "cgroup2" and "" in own and (base := _own_dir(point, root, own[""])) is not None:
                for role in _v2_controllers(base):
                    bases.setdefault(role, (2, base))
                if _v2_kill_works(base):
                    bases.setdefault("kill", (2, base))
        for point, root, kind, options in mounts:
            for controller in _V1_CONTROLLERS:
                if kind == "cgroup" and controller in options and controller in own:
                    base = _own_dir(point, root, own[controller])
                    if base is not None:
                        bases.setdefault("kill" if controller == "freezer" else controller, (1, base))
        missing = [role for role in ("memory", "pids", "cpu", "kill") if role not in bases]
        if missing:
            logger.warning(
                "sandbox: no writable cgroup for %s: the python tool's calls keep their per-process limits only "
                "(no bound on a call's total memory, shared memory included), and a call that leaves a process "
                "it cannot stop fails",
                ", ".join(missing),
            )
        return cls(bases) if bases else None

    def create(self, *, memory_bytes: int, max_tasks: int, cpus: float) -> CallCgroup:
        """A fresh cgroup per hierarchy, limits set; remove it with ``CallCgroup.remove``."""
        name = f"stare_call_{os.getpid()}_{secrets.token_hex(6)}"
        call = CallCgroup()
        try:
            for role, (version, base) in self.bases.items():
                directory = call.dirs.get(base) or base / name
                if base not in call.dirs:
                    directory.mkdir()
                    call.dirs[base] = directory
                call.roles[role] = (version, directory)
                _set_limit(role, version, directory, memory_bytes, max_tasks, cpus)
        except OSError:
            call.remove()
            raise
        return call


def _set_limit(role: str, version: int, directory: Path, memory_bytes: int, max_tasks: int, cpus: float) -> None:
    quota = max(1000, int(cpus * _CPU_PERIOD_US))
    if role == "memory" and version == 2:
        _write(directory / "memory.max", str(memory_bytes))
        if (directory / "memory.swap.max").exists():
            _write(directory / "memory.swap.max", "0")
    elif role == "memory":
        _write(directory / "memory.limit_in_bytes", str(memory_bytes))
        if (directory / "memory.memsw.limit_in_bytes").exists():  # swap included: no escape to swap
            _write(directory / "memory.memsw.limit_in_bytes", str(memory_bytes))
    elif role == "pids":
        _write(directory / "pids.max", str(max_tasks))
    elif role == "cpu" and version == 2:
        _write(directory / "cpu.max", f"{quota} {_CPU_PERIOD_US}")
    elif role == "cpu":
        _write(directory / "cpu.cfs_period_us", str(_CPU_PERIOD_US))
        _write(directory / "cpu.cfs_quota_us", str(quota))


@dataclass
class CallCgroup:
    """The cgroups of one call (one directory per hierarchy; a directory may serve several roles)."""

    dirs: dict[Path, Path] = field(default_factory=dict)  # base -> this call's directory
    roles: dict[str, tuple[int, Path]] = field(default_factory=dict)  # role -> (version, directory)

    @property
    def procs_files(self) -> list[str]:
        return [str(d / "cgroup.procs") for d in self.dirs.values()]

    def processes(self) -> set[int]:
        pids: set[int] = set()
        for directory in self.dirs.values():
            try:
                pids.update(int(p) for p in (directory / "cgroup.procs").read_text().split())
            except OSError:
                continue
        return pids

    def kill(self, deadline_seconds: float = 2.0) -> bool:
        """Kill every process of the call; True when none is left by the deadline."""
        deadline = time.monotonic() + deadline_seconds
        version, directory = self.roles.get("kill", (0, None))
        while True:
            pids = self.processes()
            if not pids:
                return True
            if time.monotonic() >= deadline:
                return False
            if version == 2:
                _write_quietly(directory / "cgroup.kill", "1")
            elif version == 1:
                self._freeze_and_kill(directory)
            else:  # no kill role: SIGKILL what is listed, repeatedly (pids.max bounds what can come back)
                _kill_all(pids)
            time.sleep(0.005)

    def _freeze_and_kill(self, freezer: Path) -> None:
        """v1: freeze (no task can fork meanwhile), SIGKILL each task, thaw so that the kills are delivered."""
        _write_quietly(freezer / "freezer.state", "FROZEN")
        settle = time.monotonic() + 0.2
        while time.monotonic() < settle and _read_quietly(freezer / "freezer.state") == "FREEZING":
            time.sleep(0.002)
        try:
            pids = {int(p) for p in (freezer / "cgroup.procs").read_text().split()}
        except OSError:
            pids = set()
        _kill_all(pids | self.processes())
        _write_quietly(freezer / "freezer.state", "THAWED")

    def memory_exhausted(self) -> bool:
        """Whether the call reached its memory limit and the kernel killed a process of it for that."""
        version, directory = self.roles.get("memory", (0, None))
        name = "memory.events" if version == 2 else "memory.oom_control"
        if directory is None:
            return False
        for line in _read_quietly(directory / name).splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill" and value.strip().isdigit():
                return int(value) > 0
        return False

    def remove(self) -> None:
        """Remove the call's directories (empty once its processes are gone); a leftover is logged."""
        for directory in self.dirs.values():
            for _ in range(50):
                try:
                    directory.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:  # busy: a process of the call is still exiting
                    time.sleep(0.01)
            else:
                logger.warning("sandbox: could not remove the call cgroup %s", directory)


def _kill_all(pids: set[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass  # gone meanwhile


def _write_quietly(path: Path, value: str) -> None:
    try:
        _write(path, value)
    except OSError:
        pass


def _read_quietly(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""
