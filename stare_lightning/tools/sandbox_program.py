"""The ``python`` tool as the policy sees it (``PythonToolSpec``), and the Python program a sandbox runs: the replay
program (one call with its episode's history).

``replay_program(code, history)`` is one self-contained script, the same for the local sandbox and a
SandboxFusion service: it seeds ``random`` with 0, re-runs the episode's earlier calls in one namespace with their
output sent to ``/dev/null`` (a replayed call that fails is skipped: state is best effort), then runs the new call.
The new call's traceback is printed without the runner's own frames and with library paths made relative, so the
model reads ``File "<code>", line 3`` rather than paths of this machine. Seeding ``random`` makes a replay draw the
numbers the original call drew (each call starts from the same seed and replays the same calls before it).

The local sandbox runs the replay program through its launcher (``sandbox_launcher.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["RUNNER", "PythonToolSpec", "replay_program"]


class PythonToolSpec:
    """The ``python`` tool's name, argument and descriptions (its function schema): the same tool whichever sandbox
    answers it, the local one (``PythonSandbox``) or a SandboxFusion service (``SandboxFusion``)."""

    name = "python"
    argument = "code"
    description = "Run Python code in a sandbox and return what it prints (stdout and stderr)."
    argument_description = "Python code to run; use print() to see values."


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
