"""What the verifier worker gives up before it scores anything: network, a writable file system, privileges, secrets.

``confine`` runs first in the worker (``worker.main``), before any verifier is imported:

1. As root: new mount, network and pid namespaces (the network namespace holds a downed loopback only, so nothing is
   reachable, the host's loopback services and the cloud metadata address included). The pid namespace takes a fork
   (``pid_namespace.py``): the process the pool started stays outside as a supervisor that only waits, and its child,
   pid 1 of the new namespace with a fresh ``/proc``, becomes the worker: it sees no other process, nor any command
   line. It dies with its supervisor, and everything in the namespace dies with it, so killing the process the
   pool knows takes the whole namespace down. In the mount namespace every mount but ``/proc`` is read-only, the
   world-writable directories become empty tmpfs (``/var/tmp`` and ``/dev/shm`` read-only, ``/tmp`` a small private
   scratch that vanishes with the worker), and directories only their owner may enter that hold what the worker
   imports (``/root`` holding a pyenv interpreter, a pytest directory holding a user verifier) become a tmpfs with
   just those paths bound back. Then the worker gives up root for a uid of its own (named in no ``/etc/passwd`` line,
   running no process), with no groups and ``no_new_privs``: it can read what any user can, and write nothing the
   host sees. Not root: the same namespaces inside a user namespace where the kernel allows one (a fresh ``/proc``
   only where the kernel lets a user namespace mount one), then a nested user namespace that maps back to the
   trainer's uid, so the worker holds no capability over those mounts; the uid stays the trainer's (a process cannot
   take another uid without privileges).
2. Resource limits: address space (``memory_limit_mb``), files of at most ``SCRATCH_MB`` (none without the mount
   namespace), no core files, 64 open files, and with a uid of its own no new process or thread (``RLIMIT_NPROC``
   at the worker's own task count).

The environment is empty from the start: the pool spawns the worker with ``worker_environment()``, so no secret
of the trainer's (API tokens) is ever in the worker's memory. ``confine`` returns a ``Confinement`` saying what held;
the pool warns once about what did not. ``scoring_guard`` adds the in-process layer.
"""

from __future__ import annotations

import ctypes
import os
import resource
import stat
import sys
import zlib
from dataclasses import dataclass
from pathlib import Path

from stare_lightning.rewards.pid_namespace import become_namespace_init, die_with_supervisor
from stare_lightning.tools.seccomp import VERIFIER as VERIFIER_SECCOMP
from stare_lightning.tools.seccomp import load as load_seccomp

__all__ = ["Confinement", "confine", "worker_environment"]

WORLD_WRITABLE = ("/tmp", "/var/tmp", "/dev/shm")
OPEN_FILES = 64
SCRATCH_MB = 16  # the worker's private /tmp, which vanishes with it
_CLONE_NEWNS, _CLONE_NEWUSER, _CLONE_NEWNET, _CLONE_NEWPID = 0x00020000, 0x10000000, 0x40000000, 0x20000000
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_REMOUNT, _MS_BIND, _MS_REC, _MS_PRIVATE = 1, 2, 4, 32, 4096, 16384, 1 << 18
_MS_NOEXEC = 8
_PR_SET_NO_NEW_PRIVS = 38
_UID_FLOOR = 200_000  # a verifier uid is drawn above this, away from real users


@dataclass(frozen=True)
class Confinement:
    """What the worker runs under (sent to the pool in its first message)."""

    uid: int
    own_uid: bool  # gave up root for a uid of its own
    network_namespace: bool  # no network at all
    mount_namespace: bool  # world-writable directories read-only, owner-only ones hidden
    memory_limit_mb: int | None
    unreadable_paths: tuple[str, ...] = ()  # import paths its uid may not read (modules there cannot load)
    pid_namespace: bool = False  # pid 1 of a namespace of its own, with its own /proc: sees no other process

    def weaknesses(self) -> list[str]:
        found = []
        if self.unreadable_paths:
            found.append(
                "cannot import from " + ", ".join(self.unreadable_paths) + " (readable by their owner only: "
                "the worker runs as a uid of its own; `chmod o+rx` them to use verifiers there)"
            )
        if not self.own_uid:
            found.append(
                f"runs as the trainer's uid {self.uid} (give the trainer root or CAP_SETUID for a uid of its own)"
            )
        if not self.network_namespace:
            found.append("has the trainer's network (no network namespace could be created)")
        if not self.mount_namespace:
            found.append("can write where the trainer's uid can (no mount namespace could be created)")
        if not self.pid_namespace:
            found.append("sees the host's processes and their command lines (no pid namespace with its own /proc)")
        return found


def worker_environment() -> dict[str, str]:
    """The whole environment of a verifier worker: nothing of the trainer's."""
    single_thread = {name: "1" for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}
    scratch = {"TMPDIR": "/tmp", "MPLCONFIGDIR": "/tmp/matplotlib"}
    return {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1", **scratch, **single_thread}


_libc = ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    def raw(text):
        return None if text is None else text.encode()

    _check(_libc.mount(raw(source), raw(target), raw(fstype), flags, raw(data)), f"mount {target}")


def _unshare(flags: int) -> bool:
    return _libc.unshare(flags) == 0


def _inside(path: str, parent: str) -> bool:
    return path == parent or path.startswith(parent.rstrip("/") + "/")


def _needed_paths() -> list[str]:
    """Where the worker may import from: every directory on ``sys.path``, the interpreter's prefixes, and the
    directory holding this package (an editable install maps it from outside ``sys.path``, and the built-in
    verifiers are imported after confinement). A world-writable directory itself (``/tmp`` as the working
    directory) is never bound back whole: that would undo hiding it."""
    cwd = os.getcwd()
    sys.path[:] = [entry or cwd for entry in sys.path]  # '' would follow the chdir below
    package_home = str(Path(__file__).resolve().parents[2])
    candidates = [*sys.path, sys.prefix, sys.base_prefix, sys.exec_prefix, package_home]
    found = {os.path.realpath(p) for p in candidates if p and os.path.isdir(p)}
    return sorted(found - {os.path.realpath(d) for d in WORLD_WRITABLE})


def _owner_only_ancestor(path: str) -> str | None:
    """The outermost directory on the way to ``path`` that other users may not enter, if any."""
    for ancestor in [*reversed(Path(path).parents), Path(path)]:
        if ancestor != Path("/") and not os.stat(ancestor).st_mode & stat.S_IXOTH:
            return str(ancestor)
    return None


def _hidden_dirs(needed: list[str], own_uid: bool) -> dict[str, list[str]]:
    """Directory to hide -> the needed paths inside it to bind back."""
    hidden: dict[str, list[str]] = {d: [] for d in WORLD_WRITABLE if os.path.isdir(d) and not os.path.islink(d)}
    for path in needed:
        outer = next((d for d in hidden if _inside(path, d)), None)
        if outer is None and own_uid:
            outer = _owner_only_ancestor(path)
            if outer is not None:
                hidden = {d: kept for d, kept in hidden.items() if not _inside(d, outer)} | {
                    outer: [p for d, kept in hidden.items() if _inside(d, outer) for p in kept]
                }
        if outer is not None:
            hidden[outer].append(path)
    return hidden


_MOUNT_OPTION_FLAGS = {"nosuid": _MS_NOSUID, "nodev": _MS_NODEV, "noexec": 8, "noatime": 1 << 10, "relatime": 1 << 21}


def _mount_points() -> list[tuple[str, int, str]]:
    """(mount point, flags to keep, file system type) of every mount this namespace sees, outermost first."""
    found = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        point = fields[4].encode().decode("unicode_escape")  # spaces and tabs come escaped as octal (\040)
        flags = sum(_MOUNT_OPTION_FLAGS.get(option, 0) for option in fields[5].split(","))
        found.append((point, flags, fields[fields.index("-") + 1]))
    return found


def _read_only_everywhere() -> None:
    """Every mount read-only (a world-writable directory anywhere would do for a dropped uid otherwise), but
    ``/proc``: it holds no files to write to, and without a uid of its own the worker must still write its user
    namespace's maps there (``_drop_capabilities_unprivileged``)."""
    for point, flags, kind in _mount_points():
        if kind == "proc":
            continue
        try:
            _mount(None, point, None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | flags)
        except OSError:
            if point == "/":
                raise  # the rest (a /proc or /sys submount) is beyond a dropped uid's reach anyway


def _others_may_enter(path: str) -> bool:
    return os.stat(path).st_mode & 0o005 == 0o005


def _binds(path: str) -> list[str]:
    """What to bind back for a needed path: itself, or, when only its owner may enter it (a checkout in a 0700
    directory), each of its entries, so that the tmpfs directory standing in for it lets the worker's uid in."""
    if _others_may_enter(path):
        return [path]
    return [os.path.join(path, entry) for entry in sorted(os.listdir(path))]


def _bind_read_only(handle: int, target: str) -> None:
    if stat.S_ISDIR(os.stat(f"/proc/self/fd/{handle}").st_mode):
        os.makedirs(target, mode=0o755, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), mode=0o755, exist_ok=True)
        open(target, "a").close()
    _mount(f"/proc/self/fd/{handle}", target, None, _MS_BIND | _MS_REC)
    _mount(None, target, None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | _MS_NOSUID | _MS_NODEV)


def _hide(hidden: dict[str, list[str]]) -> None:
    """An empty tmpfs over each hidden directory, with its needed paths bound back read-only. ``/tmp`` stays
    writable (``SCRATCH_MB``, the worker's own: libraries such as matplotlib need a cache directory to import);
    the others are read-only."""
    binds = {
        directory: [b for path in sorted(kept, key=len) for b in _binds(path)] for directory, kept in hidden.items()
    }
    handles = {}  # opened before any tmpfs hides them
    for path in (path for kept in binds.values() for path in kept):
        try:
            handles[path] = os.open(path, os.O_PATH)
        except OSError:
            continue  # a dangling link among a directory's entries: nothing to bind
    try:
        for directory, kept in binds.items():
            scratch = directory == "/tmp"
            options = f"mode=1777,size={SCRATCH_MB}m" if scratch else "mode=0755,size=64k"
            _mount("tmpfs", directory, "tmpfs", _MS_NOSUID | _MS_NODEV, options)
            for path in (path for path in kept if path in handles):
                _bind_read_only(handles[path], path)
            if not scratch:
                _mount(None, directory, None, _MS_REMOUNT | _MS_RDONLY | _MS_NOSUID | _MS_NODEV)
    finally:
        for handle in handles.values():
            os.close(handle)


def _uids_in_use() -> set[int]:
    used = set()
    try:
        for line in Path("/etc/passwd").read_text().splitlines():
            fields = line.split(":")
            if len(fields) > 2 and fields[2].isdigit():
                used.add(int(fields[2]))
    except OSError:
        pass
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                used.add(os.stat(entry.path).st_uid)
            except OSError:
                continue
    return used


def _free_uid() -> int | None:
    """A uid this user namespace maps, above ``_UID_FLOOR``, that names no user and runs no process."""
    try:
        rows = [tuple(map(int, line.split())) for line in Path("/proc/self/uid_map").read_text().splitlines()]
    except OSError:
        return None
    low, count = max(((row[0], row[2]) for row in rows), key=lambda r: r[1], default=(0, 0))
    start, end = max(low, _UID_FLOOR), low + count - 2  # the last mapped uid is often the overflow uid
    if end - start < 1000:
        return None
    used = _uids_in_use()
    span = min(end - start, 1 << 24)
    first = zlib.crc32(f"{os.getpid()}:{os.getppid()}".encode()) % span
    return next((start + (first + k) % span for k in range(4096) if start + (first + k) % span not in used), None)


def _enter_namespaces_as_root() -> tuple[bool, bool, bool]:
    """New network, mount and pid namespaces; (network, mounts, pids) that could be made. The pid namespace is
    only asked for with the mount namespace: without a ``/proc`` of its own it would hide nothing."""
    for pids in (True, False):
        if _unshare(_CLONE_NEWNS | _CLONE_NEWNET | (_CLONE_NEWPID if pids else 0)):
            _mount(None, "/", None, _MS_REC | _MS_PRIVATE)  # nothing mounted here propagates to the host
            return True, True, pids
    return _unshare(_CLONE_NEWNET), False, False


def _enter_namespaces_unprivileged(uid: int, gid: int) -> tuple[bool, bool, bool]:
    """A user namespace holding new mount, network and pid namespaces; (network, mounts, pids) that could be made."""
    flags = _CLONE_NEWUSER | _CLONE_NEWNS | _CLONE_NEWNET
    pids = _unshare(flags | _CLONE_NEWPID)
    if not pids and not _unshare(flags):
        return False, False, False
    Path("/proc/self/setgroups").write_text("deny")
    Path("/proc/self/uid_map").write_text(f"0 {uid} 1")
    Path("/proc/self/gid_map").write_text(f"0 {gid} 1")
    _mount(None, "/", None, _MS_REC | _MS_PRIVATE)
    return True, True, pids


def _fresh_proc() -> bool:
    """Mount a ``/proc`` of this pid namespace over the host's; whether the kernel allowed it."""
    try:
        _mount("proc", "/proc", "proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC)
    except OSError:
        return False
    return True


def _drop_capabilities_unprivileged(uid: int, gid: int) -> None:
    """A nested user namespace mapped back to the trainer's ids: no capability over the mounts made above."""
    if _unshare(_CLONE_NEWUSER):
        Path("/proc/self/setgroups").write_text("deny")
        Path("/proc/self/uid_map").write_text(f"{uid} 0 1")
        Path("/proc/self/gid_map").write_text(f"{gid} 0 1")


def _become(uid: int) -> None:
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)


def _limit(kind: int, value: int) -> None:
    resource.setrlimit(kind, (value, value))


def confine(memory_limit_mb: int | None) -> Confinement:
    """Confine this process (see the module docstring); call it once, first thing in the worker."""
    real_uid, real_gid = os.getuid(), os.getgid()
    needed = _needed_paths()
    if real_uid == 0:
        new_uid = _free_uid()
        network, mounts, pids = _enter_namespaces_as_root()
    else:
        new_uid = None
        network, mounts, pids = _enter_namespaces_unprivileged(real_uid, real_gid)
    supervisor_alive = become_namespace_init() if pids else None
    pids = pids and mounts and _fresh_proc()
    # Import paths the worker's own uid could still not read (bound back, but closed to others themselves).
    unreadable = tuple(p for p in needed if new_uid is not None and not mounts and not _others_may_enter(p))
    if mounts:
        _read_only_everywhere()
        _hide(_hidden_dirs(needed, own_uid=new_uid is not None))
        os.chdir("/")
    if new_uid is not None:
        _become(new_uid)
    elif real_uid != 0 and mounts:
        _drop_capabilities_unprivileged(real_uid, real_gid)
    if supervisor_alive is not None:
        die_with_supervisor(supervisor_alive)
    _check(_libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")
    if memory_limit_mb:
        _limit(resource.RLIMIT_AS, memory_limit_mb * 1024 * 1024)
    _limit(resource.RLIMIT_FSIZE, (SCRATCH_MB if mounts else 0) * 1024 * 1024)
    _limit(resource.RLIMIT_CORE, 0)
    _limit(resource.RLIMIT_NOFILE, OPEN_FILES)
    if new_uid is not None:
        _limit(resource.RLIMIT_NPROC, len(os.listdir("/proc/self/task")))
    # Last: no namespace, mount, tracing, eBPF, keyring or io_uring call, no socket but AF_UNIX (tools/seccomp.py).
    load_seccomp(VERIFIER_SECCOMP)
    return Confinement(
        unreadable_paths=unreadable,
        uid=os.getuid(),
        own_uid=new_uid is not None,
        network_namespace=network,
        mount_namespace=mounts,
        memory_limit_mb=memory_limit_mb,
        pid_namespace=pids,
    )
