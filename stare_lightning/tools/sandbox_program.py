"""The Python programs a sandbox runs: the replay program (one call with its episode's history) and the launcher.

``replay_program(code, history)`` is one self-contained script, the same for the local sandbox and a
SandboxFusion service: it seeds ``random`` with 0, re-runs the episode's earlier calls in one namespace with their
output sent to ``/dev/null`` (a replayed call that fails is skipped: state is best effort), then runs the new call.
The new call's traceback is printed without the runner's own frames and with library paths made relative, so the
model reads ``File "<code>", line 3`` rather than paths of this machine. Seeding ``random`` makes a replay draw the
numbers the original call drew (each call starts from the same seed and replays the same calls before it).

``LAUNCHER`` runs inside the local sandbox before any of the policy's code: it sets the resource limits, gives up
root (to a fresh uid, so that ``RLIMIT_NPROC`` holds: the kernel does not apply it to root), enters the scratch
directory and executes the replay program in the same interpreter (one Python start-up per call).
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["LAUNCHER", "RUNNER", "replay_program"]

# Runs in the sandbox's Python (any version >= 3.8); its names stay out of the policy's namespace.
RUNNER = r'''
import os as _os
import sys as _sys


def _quietly(code, filename, namespace):
    """Run an earlier call again with its output discarded; a failure is ignored (best-effort state)."""
    _sys.stdout.flush()
    _sys.stderr.flush()
    saved, null = (_os.dup(1), _os.dup(2)), _os.open(_os.devnull, _os.O_WRONLY)
    _os.dup2(null, 1)
    _os.dup2(null, 2)
    try:
        exec(compile(code, filename, "exec"), namespace)
    except BaseException:
        pass
    finally:
        try:
            _sys.stdout.flush()
            _sys.stderr.flush()
        except BaseException:
            pass
        _os.dup2(saved[0], 1)
        _os.dup2(saved[1], 2)
        for fd in (*saved, null):
            _os.close(fd)


def _short_traceback(exc, filename):
    """The traceback from the policy's first frame on, with this machine's library paths made relative."""
    import sysconfig
    import traceback

    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename != filename:
        tb = tb.tb_next
    text = "".join(traceback.format_exception(type(exc), exc, tb))
    paths = {sysconfig.get_paths().get(key) for key in ("purelib", "platlib", "stdlib", "platstdlib")}
    for path in sorted((p for p in paths if p), key=len, reverse=True):
        text = text.replace(path + "/", "")
    return text


def _run(history, code):
    import linecache
    import random

    random.seed(0)
    try:
        _sys.stdout.reconfigure(line_buffering=True)  # prints and a traceback come out in order
    except (AttributeError, ValueError):
        pass
    namespace = {"__name__": "__main__"}
    for number, earlier in enumerate(history, 1):
        _quietly(earlier, "<call %d>" % number, namespace)
    filename = "<code>"
    linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
    try:
        exec(compile(code, filename, "exec"), namespace)
    except SystemExit:
        raise
    except BaseException as exc:
        _sys.stdout.flush()
        _sys.stderr.write(_short_traceback(exc, filename))
        _sys.stderr.flush()
        _sys.exit(1)
'''


def replay_program(code: str, history: Sequence[str] = ()) -> str:
    """The script that replays ``history`` silently, then runs ``code`` (the literals are ``repr``s)."""
    return f"{RUNNER}\n_run({list(history)!r}, {code!r})\n"


# argv: program path, scratch dir, cpu s, memory MB, file MB, processes, uid (0: keep), keep_read (0/1).
LAUNCHER = r"""
import os, resource, sys


def _keep_reading():
    # Keep CAP_DAC_READ_SEARCH only (rlimits mode): the interpreter may live under a root-only directory.
    import ctypes

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]

    data = (Data * 2)()
    data[0].effective = data[0].permitted = 1 << 2
    return ctypes.CDLL(None, use_errno=True).capset(ctypes.byref(Header(0x20080522, 0)), data) == 0


def _drop_root(uid, workdir, keep_read):
    os.chown(workdir, uid, uid)
    if keep_read:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(8, 1, 0, 0, 0)  # PR_SET_KEEPCAPS across setuid
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
    if keep_read:
        _keep_reading()
    if os.getuid() != uid or os.geteuid() != uid or os.getegid() != uid:
        sys.exit("sandbox: could not give up root")


def _main(path, workdir, cpu, memory_mb, file_mb, processes, uid, keep_read):
    with open(path, encoding="utf-8") as handle:
        program = handle.read()
    mb = 1024 * 1024
    for kind, soft, hard in (
        (resource.RLIMIT_CORE, 0, 0),
        (resource.RLIMIT_CPU, int(cpu), int(cpu) + 1),
        (resource.RLIMIT_AS, int(memory_mb) * mb, int(memory_mb) * mb),
        (resource.RLIMIT_FSIZE, int(file_mb) * mb, int(file_mb) * mb),
        (resource.RLIMIT_NPROC, int(processes), int(processes)),
    ):
        resource.setrlimit(kind, (soft, hard))
    os.makedirs(workdir, exist_ok=True)
    if int(uid):
        _drop_root(int(uid), workdir, keep_read == "1")
    os.chdir(workdir)
    sys.argv = ["<code>"]
    return program


exec(compile(_main(*sys.argv[1:]), "<runner>", "exec"), {"__name__": "__main__"})
"""
