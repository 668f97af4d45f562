"""Verifier names -> functions: the built-ins and user functions written as ``package.module:function``.

A verifier is a pure function ``verify(response: str, answer: str, metadata: dict) -> float`` returning a
score in [0, 1]. It may carry three optional attributes: ``check_record(answer, metadata)``, which raises
ValueError for a record it could never score (called when data are loaded, so bad data fail before
training), ``warmup()``, which the pool worker calls once after importing it, and ``prepare(response, answer,
metadata)``, called before each call outside its scoring guard (to build what the call needs from trusted code).

User verifiers are imported by name, and a verifier receives model output as its first argument, so the name
must lead to a Python function (or a static method of a class) defined in the module the name gives: not a
re-export (``stare_lightning.rewards.pool:os.system`` reaches ``os.system`` through a module attribute), not a
builtin, not a private name, and never from the standard library (``os:system``, ``builtins:eval``).
"""

from __future__ import annotations

import importlib
import inspect
import re
import sys
from collections.abc import Callable

Verifier = Callable[[str, str, dict], float]

_BUILTINS: dict[str, str] = {
    "countdown": "stare_lightning.rewards.countdown:verify_countdown",
    "exact": "stare_lightning.rewards.basic:verify_exact",
    "last_number": "stare_lightning.rewards.basic:verify_last_number",
    "math": "stare_lightning.rewards.math_answer:verify_math",
    "numeric": "stare_lightning.rewards.basic:verify_numeric",
    "reasoning_gym": "stare_lightning.rewards.reasoning_gym:verify_reasoning_gym",  # needs the reasoning-gym extra
}
_USER_NAME = re.compile(r"[A-Za-z_][\w]*(?:\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*(?:\.[A-Za-z_][\w]*)*")
_cache: dict[str, Verifier] = {}


def known_verifiers() -> list[str]:
    """Names of the built-in verifiers, sorted."""
    return sorted(_BUILTINS)


def is_user_verifier_name(name: str) -> bool:
    """True for names of the form ``package.module:function``."""
    return isinstance(name, str) and ":" in name


def unknown_verifier_message(name: object) -> str:
    """The error text for a name that is neither built in nor a user function."""
    return (
        f"unknown verifier {name!r}; known verifiers: {', '.join(known_verifiers())}, "
        "or a user function written as 'package.module:function'"
    )


def _import_user(name: str) -> Verifier:
    if not _USER_NAME.fullmatch(name):
        raise ValueError(f"verifier {name!r} is not of the form 'package.module:function'")
    module_name, attr_path = name.split(":", 1)
    top = module_name.split(".", 1)[0]
    if top in sys.stdlib_module_names or top in sys.builtin_module_names:
        raise ValueError(
            f"verifier {name!r}: functions from the standard library module {top!r} are not accepted "
            "as verifiers (they would receive model output); write a verifier function in your own module"
        )
    try:
        obj = importlib.import_module(module_name)
    except Exception as exc:  # ImportError, or whatever the module raises while importing
        raise ValueError(
            f"verifier {name!r}: cannot import module {module_name!r} ({type(exc).__name__}: {exc})"
        ) from exc
    if any(part.startswith("_") for part in attr_path.split(".")):
        raise ValueError(f"verifier {name!r}: private names cannot be verifiers")
    for part in attr_path.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"verifier {name!r}: {module_name!r} has no attribute {attr_path!r}")
        obj = getattr(obj, part)
    if not inspect.isfunction(obj):
        raise ValueError(
            f"verifier {name!r} is a {type(obj).__name__}, not a Python function: write the verifier as a function "
            f"defined in {module_name!r}"
        )
    home = f"{obj.__module__}:{obj.__qualname__}"
    if home != name:
        raise ValueError(
            f"verifier {name!r} is {home}, defined elsewhere: name a function defined in the module you give "
            "(a re-export could be anything, the standard library included)"
        )
    return obj


def get_verifier(name: str) -> Verifier:
    """The verifier function called ``name``; ValueError listing the known names when there is none."""
    fn = _cache.get(name) if isinstance(name, str) else None
    if fn is not None:
        return fn
    if not isinstance(name, str) or not name:
        raise ValueError(unknown_verifier_message(name))
    if name in _BUILTINS:
        module_name, attr = _BUILTINS[name].split(":")
        fn = getattr(importlib.import_module(module_name), attr)
    elif is_user_verifier_name(name):
        fn = _import_user(name)
    else:
        raise ValueError(unknown_verifier_message(name))
    _cache[name] = fn
    return fn


def check_record(name: str, answer: str, metadata: dict) -> None:
    """Run the verifier's ``check_record`` hook if it has one (raises ValueError for unusable records)."""
    hook = getattr(get_verifier(name), "check_record", None)
    if hook is not None:
        hook(answer, metadata)
