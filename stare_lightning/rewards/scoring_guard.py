"""While a verifier scores model output, nothing it calls may reach outside the worker or run code the output wrote.

Verifiers hand model text to parsers, and popular parsers evaluate it: sympy's ``parse_expr``/``sympify`` build
Python source and ``eval`` it, several reasoning-gym scorers call ``eval(answer)`` on the answer itself. This
module is the parse-only path for all of them at once: a Python audit hook (PEP 578), active only inside
``guarded()``, refuses

- running code compiled from a string unless every name it touches (globals, attributes, nested lambdas and
  comprehensions included) is one of the sympy constructors listed in ``SYMPY_CONSTRUCTORS``, a harmless builtin or a
  one-letter variable: ``eval("[1, 2]")`` and the ``Integer(2)*Symbol('x')`` that ``sympify("2*x")`` builds run;
  ``__import__('os')``, ``open(...)``, ``().__class__``, ``lazy_function('os', ...)`` and any module attribute do not.
  Two kinds of code are not text and run unchecked, told apart by who calls ``exec`` (not by the code's file name,
  which ``compile`` lets anyone choose): a module that the import system's own file loaders read from disk (sympy
  imports submodules lazily, mid-call), and the code that three library generators build from their own templates
  (``dataclasses``, ``collections.namedtuple``, sympy's ``MonomialOps``);
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
import importlib
import importlib._bootstrap as bootstrap
import importlib._bootstrap_external as bootstrap_external
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
# What text may build, reviewed name by name. The core is what ``sympify``/``parse_expr`` (all transformations,
# evaluate on or off) emit for a corpus of typical answers (fractions, roots, powers, pi, intervals, sets, matrices,
# trig and log functions, relations): Integer, Float, Rational, Symbol, Function, Add, Mul, Pow, Eq and the like;
# math-verify's LaTeX parser builds its sympy objects directly and its plain-text path is ``parse_expr``. The rest is
# the vocabulary an answer may name (``gamma(5)``, ``Interval(0, 1)``), each a constructor or function that only
# builds or simplifies an expression. Not here on purpose: anything that imports (``lazy_function``), evaluates or
# generates code (``sympify``, ``parse_expr``, ``lambdify``, ``var``), changes global state (``evaluate``,
# ``init_printing``), prints, plots or writes, and every module attribute (``sympy.core``).
SYMPY_CONSTRUCTORS = frozenset(
    """
    Symbol Integer Rational Float Add Mul Pow Function Lambda Tuple S
    pi E I oo zoo nan EulerGamma GoldenRatio Catalan
    sqrt cbrt root real_root exp log ln LambertW Abs sign floor ceiling frac Max Min re im arg conjugate
    sin cos tan cot sec csc asin acos atan acot asec acsc atan2 sinc
    sinh cosh tanh coth sech csch asinh acosh atanh acoth asech acsch
    factorial factorial2 subfactorial binomial RisingFactorial FallingFactorial
    gamma beta digamma polygamma loggamma zeta erf erfc fibonacci lucas catalan harmonic
    gcd lcm Mod Heaviside DiracDelta Piecewise
    Eq Ne Lt Le Gt Ge And Or Not Xor Implies true false
    Interval FiniteSet Union Intersection Complement SymmetricDifference ProductSet EmptySet
    Reals Integers Naturals Naturals0 Rationals Complexes Range
    Matrix ImmutableMatrix Integral Derivative Limit Sum Product
    """.split()
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
    generators: frozenset[types.CodeType] = frozenset()


def allowed_names() -> frozenset[str]:
    """The names code compiled from text may use under the guard (besides one-letter variables).

    ``sympy`` itself is one: ``parse_expr``'s first step is ``exec("from sympy import *")``; whatever is reached
    through it is name-checked like the rest."""
    return SYMPY_CONSTRUCTORS | SAFE_BUILTINS | {"sympy"}


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


class _Import:
    """The import system's functions that run a module's code (looked up once: nothing is imported in the hook)."""

    call_code = bootstrap._call_with_frames_removed.__code__
    exec_module_code = bootstrap_external._LoaderBasics.exec_module.__code__
    file_loaders = (bootstrap_external.SourceFileLoader, bootstrap_external.SourcelessFileLoader)


# Library functions that ``exec`` code built from their own templates, never from their caller's text (module,
# qualified name); where a Python version lacks one (``dataclasses`` moved its code to ``_FuncBuilder`` in 3.13),
# it is skipped.
_CODE_GENERATORS = (
    ("collections", "namedtuple"),
    ("dataclasses", "_create_fn"),
    ("dataclasses", "_FuncBuilder.add_fns_to_class"),
    ("sympy.polys.monomials", "MonomialOps._build"),
)


def _code_generators() -> frozenset[types.CodeType]:
    found = set()
    for module_name, qualified_name in _CODE_GENERATORS:
        try:
            target = importlib.import_module(module_name)
        except ImportError:
            continue
        for part in qualified_name.split("."):
            target = getattr(target, part, None)
        code = getattr(target, "__code__", None)
        if isinstance(code, types.CodeType):
            found.add(code)
    return frozenset(found)


def _module_from_disk(caller: types.FrameType | None, code: types.CodeType) -> bool:
    """``code`` is a module's, run by the import system: ``exec_module`` of a file loader (source or bytecode)
    hands it to ``exec`` through ``_call_with_frames_removed``; the file system the worker sees is read-only."""
    if caller is None or caller.f_code is not _Import.call_code:
        return False
    loader_frame = caller.f_back
    if loader_frame is None or loader_frame.f_code is not _Import.exec_module_code:
        return False
    local = loader_frame.f_locals
    loader, module = local.get("self"), local.get("module")
    spec = getattr(module, "__spec__", None)
    return (
        local.get("code") is code
        and type(loader) in _Import.file_loaders
        and getattr(spec, "origin", None) == code.co_filename
    )


def _text_code(caller: types.FrameType | None, code: types.CodeType) -> bool:
    """Whether ``exec``/``eval`` called from ``caller`` may be running code built from text (and must be checked)."""
    if caller is not None and caller.f_code in _State.generators:
        return False
    return not _module_from_disk(caller, code)


def _writes(args: tuple) -> bool:
    _path, mode, flags = (tuple(args) + (None, None, 0))[:3]
    if isinstance(mode, str) and any(c in mode for c in "wax+"):
        return True
    return isinstance(flags, int) and bool(flags & _WRITE_FLAGS)


def _refusal(event: str, args: tuple, caller: types.FrameType | None) -> str | None:
    if event == "exec":
        code = args[0] if args else None
        if isinstance(code, types.CodeType) and _text_code(caller, code):
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
    # Frame 1 is the Python code that raised the event (``exec``/``eval`` are C functions and add no frame).
    reason = _refusal(event, args, sys._getframe(1) if event == "exec" else None)
    if reason is not None:
        _State.violations.append(reason)
        raise ScoringViolation(f"refused while scoring: {reason}")


def install() -> None:
    """Add the audit hook to this process (once; it cannot be removed). Call it in the verifier worker only."""
    if _State.installed:
        return
    _State.allowed_names = allowed_names()
    _State.generators = _code_generators()
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
