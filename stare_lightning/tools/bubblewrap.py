"""The bubblewrap command line of one sandboxed call: what the policy's code can see, write and reach.

Mounts are an allowlist: the sandbox's root is bubblewrap's empty tmpfs (made read-only) holding, read-only, only
what the interpreter needs: ``/usr``, ``/bin``, ``/sbin``, ``/lib*`` (symlinks where the host has symlinks),
``/etc`` with its secrets (``SECRETS``: password hashes, sudoers, ssh and TLS private keys) hidden, and the Python
installation (``runtime_dirs``: ``sys.prefix``, ``sys.base_prefix``, the standard library and every
site-packages directory on ``sys.path``, each by its real path, wherever it lives).
Nothing else of the host is there: not the trainer's working directory, the checkout, the data and output
directories, ``/home``, ``/root`` (but for the runtime under it), ``/opt``, ``/var`` or ``/srv``. Over it:
``/tmp`` a private tmpfs of ``scratch_mb`` (the writable scratch directory ``/tmp/work`` is in it, so what a call
writes is bounded in total and vanishes with the sandbox), ``/dev`` a minimal one (with its own ``/dev/shm``),
``/proc`` the procfs of the sandbox's own pid namespace (no host process, so no trainer environment, is visible).
The runtime is bound after the private ``/tmp``, so an installation under the host's ``/tmp`` stays visible, and
the interpreter runs by its real path (``sandbox_python``): a virtual environment reached through a symlink (a
checkout whose ``.venv`` links elsewhere) is there under its real path only.

New network, pid, ipc, uts and cgroup namespaces (the network namespace has its own loopback, up, and no other
interface: nothing of the host is reachable, not even its loopback services); ``--die-with-parent`` and
``--new-session``; an environment that holds only the variables of ``sandbox_env``; and, when ``seccomp_fd`` is
given, the seccomp filter of ``seccomp.py`` read from that file descriptor.
"""

from __future__ import annotations

import os
import shutil
import sys
import sysconfig
from pathlib import Path

__all__ = [
    "BUBBLEWRAP_MISSING",
    "SECRETS",
    "bubblewrap_argv",
    "bubblewrap_path",
    "runtime_dirs",
    "sandbox_env",
    "sandbox_python",
]

BUBBLEWRAP_MISSING = (
    "isolation=bubblewrap needs bubblewrap (bwrap), which is not installed: `apt-get install bubblewrap` "
    "(`make install` does it where it can), or opt in to the weaker tools.isolation=rlimits_unsafe (resource "
    "limits and, where the kernel allows, namespaces: the code can read the host's files outside the home "
    "directories), or tools.isolation=sandbox_fusion with a service"
)
CALL_DIR = "/tmp/.call"  # the host's per-call directory (the program), read-only
WORK_DIR = "/tmp/work"  # the writable scratch directory, the code's working directory and HOME
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")
SECRETS = (
    "/etc/shadow",
    "/etc/gshadow",
    "/etc/shadow-",
    "/etc/gshadow-",
    "/etc/sudoers",
    "/etc/sudoers.d",
    "/etc/ssh",
    "/etc/ssl/private",
)


def bubblewrap_path() -> str | None:
    return shutil.which("bwrap")


def sandbox_env(home: str) -> dict[str, str]:
    """The whole environment of a sandboxed call: nothing of the trainer's.

    One thread per numerical library, so that numpy stays within the process limit (and off the trainer's cores).
    """
    one = "1"
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": home,
        "TMPDIR": home,
        "LANG": "C.UTF-8",
        "PYTHONDONTWRITEBYTECODE": one,
        "OMP_NUM_THREADS": one,
        "OPENBLAS_NUM_THREADS": one,
        "MKL_NUM_THREADS": one,
    }


def _inside(path: str, parent: str) -> bool:
    return path == parent or path.startswith(parent.rstrip("/") + "/")


def sandbox_python() -> str:
    """The interpreter by its real directory: ``<real venv>/bin/python``, not a path through a symlinked ``.venv``
    (absent in the sandbox) nor the fully resolved base interpreter (which would lose the virtual environment,
    found from ``pyvenv.cfg`` beside the path Python is started by)."""
    executable = os.path.abspath(sys.executable)
    return os.path.join(os.path.realpath(os.path.dirname(executable)), os.path.basename(executable))


def _site_packages_on_path() -> list[str]:
    """site-packages directories on ``sys.path`` (those a ``.pth`` file added included), but no other entry: the
    checkout of an editable install, or the working directory, stays out."""
    return [entry for entry in sys.path if os.path.basename(entry.rstrip("/")) in ("site-packages", "dist-packages")]


def runtime_dirs() -> list[str]:
    """Where the interpreter, its standard library and site-packages really live (outermost only)."""
    dirs = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix, *_site_packages_on_path()}
    dirs.add(os.path.dirname(sandbox_python()))
    dirs.add(str(Path(os.path.realpath(sys.executable)).parent.parent))
    dirs.update(sysconfig.get_paths().get(key) or "" for key in ("stdlib", "platstdlib", "purelib", "platlib"))
    real = {os.path.realpath(d) for d in dirs if d and os.path.isdir(d)}
    return sorted(d for d in real if not any(o != d and _inside(d, o) for o in real))


def _system_args() -> list[str]:
    """The system directories, read-only (a symlink such as ``/bin -> usr/bin`` as the same symlink)."""
    args: list[str] = []
    for path in SYSTEM_DIRS:
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    for path in SECRETS:
        if os.path.isdir(path) and not os.path.islink(path):
            args += ["--tmpfs", path, "--remount-ro", path]
        elif os.path.exists(path):
            args += ["--ro-bind", "/dev/null", path]
    return args


def _runtime_args() -> list[str]:
    """The Python installation, read-only, with world-readable parents (bwrap would make them root-only)."""
    args: list[str] = []
    made: set[str] = set()
    for runtime in runtime_dirs():
        if any(_inside(runtime, s) for s in SYSTEM_DIRS if not os.path.islink(s)):
            continue  # there already
        if runtime == "/tmp" or _inside(runtime, WORK_DIR) or _inside(runtime, CALL_DIR):
            raise RuntimeError(
                f"the Python installation at {runtime} cannot be bound into the sandbox: {WORK_DIR} and "
                f"{CALL_DIR} are the sandbox's own; move the virtual environment elsewhere"
            )
        for ancestor in reversed(Path(runtime).parents):
            step = str(ancestor)
            if step not in ("/", "/tmp") and step not in made:
                args += ["--perms", "0755", "--dir", step]
                made.add(step)
        args += ["--ro-bind", runtime, runtime]
    return args


def bubblewrap_argv(
    bwrap: str, call_dir: str, scratch_mb: int, launcher_args: list[str], seccomp_fd: int | None = None
) -> list[str]:
    """The command line that runs ``launcher_args`` (``python -I -B -c <launcher> ...``) in the sandbox."""
    args = [bwrap, *_system_args(), "--dev", "/dev", "--proc", "/proc"]
    args += ["--size", str(scratch_mb * 1024 * 1024), "--perms", "1777", "--tmpfs", "/tmp"]
    # After the private /tmp: a runtime under the host's /tmp is bound over it, not hidden by it.
    args += [*_runtime_args(), "--ro-bind", call_dir, CALL_DIR, "--remount-ro", "/"]
    # No user namespace when run as root: the launcher then gives up root itself (so RLIMIT_NPROC applies).
    args += ["--unshare-net", "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]
    args += ["--hostname", "sandbox", "--die-with-parent", "--new-session", "--clearenv"]
    if seccomp_fd is not None:
        args += ["--seccomp", str(seccomp_fd)]
    for key, value in sandbox_env(WORK_DIR).items():
        args += ["--setenv", key, value]
    return [*args, "--chdir", "/tmp", "--", *launcher_args]
