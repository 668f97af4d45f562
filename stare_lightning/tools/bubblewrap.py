"""The bubblewrap command line of one sandboxed call: what the policy's code can see, write and reach.

The sandbox's root is the host's root, read-only. Over it:
- ``/root``, ``/home``, ``/run``, ``/var/tmp``, ``/mnt``, ``/media``, ``/srv``, the trainer's working directory and
  the project checkout are hidden behind empty read-only tmpfs (the code cannot read the trainer's files or
  caches); only the Python installation (``sys.prefix``, ``sys.base_prefix``: the interpreter, its standard library
  and the site-packages with numpy, sympy, ...) is bound back in, read-only, where it lives under a hidden directory;
- ``/tmp`` is a private tmpfs of ``scratch_mb`` (the writable scratch directory ``/tmp/work`` is in it, so what a
  call writes is bounded in total and vanishes with the sandbox), ``/dev`` a minimal one, ``/proc`` the procfs of
  the sandbox's own pid namespace (no host process, so no trainer environment, is visible);
- new network (loopback only, down), pid, ipc, uts and cgroup namespaces; ``--die-with-parent`` and
  ``--new-session``; an environment that holds only the variables of ``sandbox_env``.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Iterable
from pathlib import Path

__all__ = ["BUBBLEWRAP_MISSING", "bubblewrap_argv", "bubblewrap_path", "hidden_dirs", "sandbox_env"]

BUBBLEWRAP_MISSING = (
    "isolation=bubblewrap needs bubblewrap (bwrap), which is not installed: `apt-get install bubblewrap` "
    "(`make install` does it where it can), or opt in to the weaker tools.isolation=rlimits (resource limits "
    "only: the code can read files and open sockets), or tools.isolation=sandbox_fusion with a service"
)
CALL_DIR = "/tmp/.call"  # the host's per-call directory (the program), read-only
WORK_DIR = "/tmp/work"  # the writable scratch directory, the code's working directory and HOME
_ALWAYS_HIDDEN = ("/root", "/home", "/run", "/var/tmp", "/mnt", "/media", "/srv")
# Hiding these (or a directory inside them) would hide the system the interpreter runs on.
_SYSTEM = ("/usr", "/lib", "/lib32", "/lib64", "/libx32", "/bin", "/sbin", "/etc", "/proc", "/sys", "/dev", "/tmp")


def bubblewrap_path() -> str | None:
    return shutil.which("bwrap")


def sandbox_env(home: str) -> dict[str, str]:
    """The whole environment of a sandboxed call: nothing of the trainer's.

    One thread per numerical library, so that numpy stays within the process limit (and off the trainer's cores).
    """
    one = "1"
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": home, "TMPDIR": home, "LANG": "C.UTF-8",
            "PYTHONDONTWRITEBYTECODE": one, "OMP_NUM_THREADS": one, "OPENBLAS_NUM_THREADS": one,
            "MKL_NUM_THREADS": one}  # fmt: skip


def _inside(path: str, parent: str) -> bool:
    return path == parent or path.startswith(parent.rstrip("/") + "/")


def _project_root() -> str | None:
    """The checkout this package runs from (None when it is installed in site-packages)."""
    root = Path(__file__).resolve().parents[2]
    return str(root) if (root / "pyproject.toml").exists() or (root / ".git").exists() else None


def hidden_dirs() -> list[str]:
    """The directories to hide, outermost only, never the system's."""
    candidates = [*_ALWAYS_HIDDEN, os.getcwd(), os.path.expanduser("~"), _project_root()]
    real = {os.path.realpath(c) for c in candidates if c and os.path.isdir(c)}
    kept = [p for p in real if p != "/" and not any(_inside(p, s) or _inside(s, p) for s in _SYSTEM)]
    return sorted(p for p in kept if not any(q != p and _inside(p, q) for q in kept))


def _runtime_dirs() -> list[str]:
    """Where the interpreter, its standard library and site-packages live."""
    dirs = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    dirs.add(str(Path(os.path.realpath(sys.executable)).parent.parent))
    return sorted({os.path.realpath(d) for d in dirs if d and os.path.isdir(d)})


def _hiding_args(hidden: Iterable[str]) -> list[str]:
    """tmpfs over each hidden directory, the runtime directories bound back (read-only, with readable parents),
    then each hidden tmpfs made read-only."""
    hidden = list(hidden)
    args: list[str] = []
    for path in hidden:
        args += ["--tmpfs", path]
    made: set[str] = set()
    for runtime in _runtime_dirs():
        parent = next((h for h in hidden if _inside(runtime, h)), None)
        if parent is None:
            continue  # visible anyway
        for ancestor in reversed(Path(runtime).parents):  # bwrap would create them root-only (0700)
            step = str(ancestor)
            if _inside(step, parent) and step != parent and step not in made:
                args += ["--perms", "0755", "--dir", step]
                made.add(step)
        args += ["--ro-bind", runtime, runtime]
    for path in hidden:
        args += ["--remount-ro", path]
    return args


def bubblewrap_argv(bwrap: str, call_dir: str, scratch_mb: int, launcher_args: list[str]) -> list[str]:
    """The command line that runs ``launcher_args`` (``python -I -B -c LAUNCHER ...``) in the sandbox."""
    args = [bwrap, "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", *_hiding_args(hidden_dirs())]
    args += ["--size", str(scratch_mb * 1024 * 1024), "--perms", "1777", "--tmpfs", "/tmp"]
    args += ["--ro-bind", call_dir, CALL_DIR]
    # No user namespace when run as root: the launcher then gives up root itself (so RLIMIT_NPROC applies).
    args += ["--unshare-net", "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]
    args += ["--hostname", "sandbox", "--die-with-parent", "--new-session", "--clearenv"]
    for key, value in sandbox_env(WORK_DIR).items():
        args += ["--setenv", key, value]
    return [*args, "--chdir", "/tmp", "--", *launcher_args]
