"""The validation helpers every config schema uses, so a bad value fails the same way wherever it is set.

Each helper raises ``ValueError`` naming the full config key, the value given and what is allowed, e.g.
``algorithm.stare.top_ratio=1.5 is out of range: must be a number in [0.0, 1.0]``. A value of the wrong
kind (a string, a bool where a number belongs, NaN) "is not allowed"; a number of the right kind outside
its bounds "is out of range". Checks of the values of several keys together stay with their schema.
Inside ``recorded_rules()`` every helper also notes, by key, what it allows: the configuration reference is
generated from these notes, so the documented values are the checked ones.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Iterator
from typing import Any

__all__ = ["choice", "flag", "note", "number", "recorded_rules", "text"]

_recorders: list[dict[str, str]] = []


@contextlib.contextmanager
def recorded_rules() -> Iterator[dict[str, str]]:
    """While inside, each check notes ``key -> what is allowed`` (the first note of a key wins) in the dict it
    yields, whether or not the value passes."""
    rules: dict[str, str] = {}
    _recorders.append(rules)
    try:
        yield rules
    finally:
        _recorders.remove(rules)


def _note(key: str, rule: str) -> None:
    for rules in _recorders:
        rules.setdefault(key, rule)


def _show(value: Any) -> str:
    """A value as a user writes it in YAML or on the command line (``null``, ``true``), else its repr."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value)


def note(key: str, rule: Callable[[], str]) -> None:
    """Note what ``key`` allows where the values depend on another key, so no single helper states them all;
    ``rule`` is called only while rules are recorded (the reference pages): a costly listing costs a run nothing.
    Call it before the helpers that check ``key`` (the first note of a key wins)."""
    if _recorders:
        _note(key, rule())


def choice(key: str, value: Any, allowed: Iterable[Any]) -> None:
    """``value`` must be one of ``allowed`` (include ``None`` to allow ``null``)."""
    allowed = tuple(allowed)
    _note(key, f"one of [{', '.join(_show(a) for a in allowed)}]")
    if value not in allowed:
        raise ValueError(f"{key}={value!r} is not allowed: choose one of [{', '.join(_show(a) for a in allowed)}]")


def registered_choice(key: str, value: Any, *, default: Any, names: Callable[[], Iterable[Any]]) -> None:
    """``choice`` against names only the implementations know (a registry, a module's constants), fetched by
    ``names()`` unless ``value`` is the schema's own ``default``: building a default schema (Hydra does, to compose)
    then imports no implementation. Defaults are checked against their registries by test
    (tests/test_algorithms_config.py); while rules are recorded (the reference pages) the names are always read."""
    if value == default and not _recorders:
        return
    choice(key, value, names())


def flag(key: str, value: Any) -> None:
    """``value`` must be a bool (``1`` or ``"yes"`` are refused: YAML spells it true or false)."""
    _note(key, "true or false")
    if not isinstance(value, bool):
        raise ValueError(f"{key}={value!r} is not allowed: must be true or false")


def text(key: str, value: Any) -> None:
    """``value`` must be a non-empty string."""
    _note(key, "a non-empty string")
    if not isinstance(value, str) or not value:
        raise ValueError(f"{key}={value!r} is not allowed: must be a non-empty string")


def _bounds(low: float, high: float, low_open: bool, high_open: bool, integer: bool, allow_inf: bool) -> str:
    kind = "an integer" if integer else "a number"
    if low == -math.inf and high == math.inf:
        return f"must be {kind}" if allow_inf or integer else "must be a finite number"
    if high == math.inf:
        return f"must be {kind} {'>' if low_open else '>='} {low}"
    if low == -math.inf:
        return f"must be {kind} {'<' if high_open else '<='} {high}"
    return f"must be {kind} in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"


def number(
    key: str,
    value: Any,
    *,
    low: float = -math.inf,
    high: float = math.inf,
    low_open: bool = False,
    high_open: bool = False,
    integer: bool = False,
    allow_inf: bool = False,
) -> None:
    """``value`` must be a number (an int when ``integer``) within the bounds; NaN never, +-inf only with ``allow_inf``.

    Bounds are closed unless ``low_open`` / ``high_open``. Bools are refused although Python counts them as ints.
    """
    allowed = _bounds(low, high, low_open, high_open, integer, allow_inf)
    _note(key, allowed.removeprefix("must be "))
    wrong_kind = (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or (integer and not isinstance(value, int))
        or math.isnan(value)
        or (math.isinf(value) and not allow_inf)
    )
    if wrong_kind:
        raise ValueError(f"{key}={value!r} is not allowed: {allowed}")
    above = value > low if low_open else value >= low
    below = value < high if high_open else value <= high
    if not (above and below):
        raise ValueError(f"{key}={value!r} is out of range: {allowed}")
