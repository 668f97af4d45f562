"""While a verifier scores model output, nothing it calls may reach outside the worker or run code the output wrote.

Verifiers hand model text to parsers, and popular parsers evaluate it: sympy's ``parse_expr``/``sympify`` build
Python source and ``eval`` it, several reasoning-gym scorers call ``eval(answer)`` on the answer itself. This
module is the parse-only path for all of them at once: a Python audit hook (PEP 578), active only inside
``guarded()``, refuses

- running code compiled from a string unless every name it touches (globals, attributes, nested lambdas and
  comprehensions included) is a public sympy constructor, a harmless builtin or a one-letter variable:
  ``eval("[1, 2]")`` and the ``Integer(2)*Symbol('x')`` that ``sympify("2*x")`` builds run;
  ``__import__('os')``, ``open(...)``, ``().__class__`` and any module attribute do not;
- starting processes, opening sockets, writing, renaming or deleting files, loading native code with ctypes,
  unpickling, changing resource limits.

A refusal raises ``ScoringViolation``, a ``BaseException`` (a scorer's ``except Exception`` cannot swallow it), and
is recorded, so the worker scores the item 0 even when a bare ``except:`` swallowed the exception. Audit hooks
cannot be removed once added; the hook is installed in the verifier worker only, never in the trainer. It is one
layer: the worker also runs confined (``confinement.py``), so code that found another way to run still has no
network, no writable file system and no privileges.
"""

from __future__ import annotations

import contextlib
import os
import sys
import types
from collections.abc import Iterator

__all__ = ["ScoringViolation", "allowed_names", "guarded", "install", "string_code_refusal"]

# Builtins that compute and nothing else; everything else (open, getattr, type, vars, exec, ...) is refused.
SAFE_BUILTINS = frozenset(
    "abs all any bool complex dict divmod enumerate float frozenset int len list max min pow range reversed "
    "round set slice sorted str sum tuple zip True False None".split()
)
# Public sympy names that do more than build an expression: run tests or sessions, draw, write, generate code.
_SYMPY_REFUSED = frozenset(
    "test doctest init_session init_printing preview lambdify var interactive pprint pprint_use_unicode "
    "pretty_print print_tree print_gtk print_mathml print_python print_rcode print_fcode print_glsl "
    "print_ccode print_jscode print_maple_code print_latex textplot".split()
)
# Audit events refused while guarded, by exact name or by prefix (``socket.`` covers connect, bind, getaddrinfo...).
_REFUSED_EVENTS = frozenset(
    "os.system os.exec os.posix_spawn os.spawn os.fork os.forkpty os.startfile os.kill os.killpg subprocess.Popen "
    "os.remove os.rename os.rmdir os.mkdir os.chmod os.chown os.link os.symlink os.truncate os.utime os.putenv "
    "os.unsetenv os.chdir pickle.find_class resource.setrlimit resource.prlimit mmap.__new__ sys.addaudithook "
    "shutil.rmtree shutil.copyfile shutil.move shutil.chown webbrowser.open".split()
)
_REFUSED_PREFIXES = ("socket.", "ctypes.", "_posixsubprocess.", "urllib.", "http.", "ftplib.", "smtplib.")
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC


class ScoringViolation(BaseException):
    """A verifier did something a scoring call may not do (see the module docstring)."""


class _State:
    active = False
    installed = False
    violations: list[str] = []
    allowed_names: frozenset[str] = frozenset()


def _sympy_names() -> frozenset[str]:
    try:
        import sympy
    except ImportError:
        return frozenset()
    # ``sympy`` itself: sympify's first step is ``from sympy import *``; what is reached through it is name-checked.
    return frozenset({"sympy"}) | frozenset(
        name
        for name in dir(sympy)
        if not name.startswith("_")
        and name not in _SYMPY_REFUSED
        and not name.startswith(("plot", "print"))
        and not isinstance(getattr(sympy, name, None), types.ModuleType)
    )


def allowed_names() -> frozenset[str]:
    """The names code compiled from text may use under the guard (besides one-letter variables)."""
    return _sympy_names() | SAFE_BUILTINS


def _names(code: types.CodeType) -> Iterator[str]:
    """Every global and attribute name of ``code`` and the code objects nested in it."""
    yield from code.co_names
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _names(const)


def _math_variable(name: str) -> bool:
    """One ASCII letter: the variables a parser's local names bind (``x``, and ``C`` for integration constants)."""
    return len(name) == 1 and name.isascii() and name.isalpha()


def string_code_refusal(code: types.CodeType, allowed: frozenset[str] | None = None) -> str | None:
    """Why code compiled from a string may not run under the guard, or None when it may."""
    allowed = _State.allowed_names if allowed is None else allowed
    refused = sorted(
        {name for name in _names(code) if not _math_variable(name) and (name.startswith("_") or name not in allowed)}
    )
    return f"evaluating text that uses {', '.join(refused[:5])}" if refused else None


def _from_file(code: types.CodeType) -> bool:
    """Code of an imported module (a lazily imported sympy submodule, say), not code compiled from text."""
    return os.path.isabs(code.co_filename) and os.path.exists(code.co_filename)


def _writes(args: tuple) -> bool:
    _path, mode, flags = (tuple(args) + (None, None, 0))[:3]
    if isinstance(mode, str) and any(c in mode for c in "wax+"):
        return True
    return isinstance(flags, int) and bool(flags & _WRITE_FLAGS)


def _refusal(event: str, args: tuple) -> str | None:
    if event == "exec":
        code = args[0] if args else None
        if isinstance(code, types.CodeType) and not _from_file(code):
            return string_code_refusal(code)
        return None
    if event == "open":
        return f"opening {args[0]!r} for writing" if _writes(args) else None
    if event in _REFUSED_EVENTS or event.startswith(_REFUSED_PREFIXES):
        return event
    return None


def _hook(event: str, args: tuple) -> None:
    if not _State.active:
        return
    reason = _refusal(event, args)
    if reason is not None:
        _State.violations.append(reason)
        raise ScoringViolation(f"refused while scoring: {reason}")


def install() -> None:
    """Add the audit hook to this process (once; it cannot be removed). Call it in the verifier worker only."""
    if _State.installed:
        return
    _State.allowed_names = allowed_names()
    sys.addaudithook(_hook)
    _State.installed = True


@contextlib.contextmanager
def guarded() -> Iterator[list[str]]:
    """Refuse the events above for the duration; yields the list of refusals recorded meanwhile."""
    if not _State.installed:
        raise RuntimeError("scoring_guard.install() must be called before guarded()")
    _State.violations = []
    _State.active = True
    try:
        yield _State.violations
    finally:
        _State.active = False
