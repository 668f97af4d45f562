"""The countdown verifier: does the response combine the given numbers, each exactly once, into the target?

Reads the expression from the last ``\\boxed{}`` or ``Answer:`` line when the response has one
(instruct style), otherwise from the whole response (plain style, e.g. ``3*5+7``). A trailing
``= 22`` is ignored, LaTeX ``\\times``/``\\cdot``/``\\div`` and the signs x-times/divide are read as
``*`` and ``/``. The expression goes through the safe evaluator in :mod:`.expr` (no ``eval``), with the
operators listed in ``metadata["ops"]`` (default ``+-*/``). Record metadata must hold ``numbers``
(list of int); the target is ``metadata["target"]`` or else the integer in ``answer``.
"""

from __future__ import annotations

from collections import Counter

from .expr import ExpressionError, evaluate, int_literals, parse_expression
from .extract import final_answer, strip_math_delimiters

_REPLACEMENTS = (
    ("\\times", "*"),
    ("\\cdot", "*"),
    ("\\div", "/"),
    ("\u00d7", "*"),
    ("\u00f7", "/"),
    ("\u2212", "-"),
    ("\\left", ""),
    ("\\right", ""),
)


def _target(answer: str, metadata: dict) -> int:
    target = metadata.get("target")
    if target is None:
        return int(str(answer).strip())
    return int(target)


def expression_from_response(response: str) -> str:
    """The candidate expression text: boxed / Answer: content if present, else the whole response."""
    text = final_answer(response)
    if text is None:
        text = response
    text = strip_math_delimiters(text)
    for old, new in _REPLACEMENTS:
        text = text.replace(old, new)
    if "=" in text:
        text = text.split("=", 1)[0]
    return text.strip()


def verify_countdown(response: str, answer: str, metadata: dict) -> float:
    """1.0 when the expression uses exactly ``metadata['numbers']`` (each once) and equals the target."""
    numbers = metadata["numbers"]
    target = _target(answer, metadata)
    ops = metadata.get("ops", "+-*/")
    try:
        node = parse_expression(expression_from_response(response), ops)
    except ExpressionError:
        return 0.0
    if Counter(int_literals(node)) != Counter(int(n) for n in numbers):
        return 0.0
    try:
        value = evaluate(node)
    except ZeroDivisionError:
        return 0.0
    return 1.0 if value == target else 0.0


def check_countdown_record(answer: str, metadata: dict) -> None:
    """Raise ValueError when a record cannot be scored by the countdown verifier."""
    numbers = metadata.get("numbers")
    if not isinstance(numbers, (list, tuple)) or not numbers:
        raise ValueError("countdown records need metadata key 'numbers': a non-empty list of integers")
    if any(type(n) is not int or n < 0 for n in numbers):
        raise ValueError(f"metadata 'numbers' must hold non-negative integers, got {list(numbers)!r}")
    ops = metadata.get("ops", "+-*/")
    if not isinstance(ops, str) or not ops or set(ops) - set("+-*/"):
        raise ValueError(f"metadata 'ops' must be a non-empty string of + - * /, got {ops!r}")
    try:
        target = _target(answer, metadata)
    except (TypeError, ValueError):
        raise ValueError(
            f"countdown records need an integer target (metadata 'target' or the answer), got answer {answer!r}"
        ) from None
    if metadata.get("target") is not None and str(answer).strip() != str(target):
        raise ValueError(f"answer {answer!r} disagrees with metadata 'target' {metadata['target']!r}")


verify_countdown.check_record = check_countdown_record
