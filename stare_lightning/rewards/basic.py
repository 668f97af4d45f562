"""Simple verifiers: ``exact`` (normalised string match), ``numeric`` (number match with tolerance) and
``last_number`` (the last number written anywhere in the response, compared like ``numeric``).

Both read the final answer from the last ``\\boxed{}`` or ``Answer:`` line when the response has one,
and from the whole response otherwise (plain style: the response *is* the answer).

- exact: strip math delimiters and a trailing full stop, collapse whitespace, compare case-insensitively.
- numeric: the candidate must be a single number: integer, decimal, scientific notation, ``a/b`` or
  ``\\frac{a}{b}``, with optional thousands commas, ``$`` or ``%``. Two numbers match when they are
  equal (exactly, as fractions) or within ``rel_tol`` (default 1e-6) or ``abs_tol`` (default 1e-9) of
  each other, both overridable per record through metadata. Text that is not a single number scores 0;
  a reference answer that is not a number is refused when the data are loaded.
- last_number: a lenient reading for small models that answer in prose ("7 + 7 is 14."): the last integer or
  decimal in the response (``\\boxed{}``/``Answer:`` not needed), like the "flexible extract" of common
  evaluation harnesses. It rewards any text whose last number is right, so use it only where the answer is
  a bare number and prose cannot game it cheaply.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction

from .extract import final_answer, strip_math_delimiters

_MAX_NUMBER_CHARS = 64
_DECIMAL = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)")
_SCIENTIFIC = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)[eE][+-]?\d{1,4}")
_SLASH = re.compile(r"([+-]?)(\d+)/(\d+)")
_LATEX_FRAC = re.compile(r"([+-]?)\\[dt]?frac\{([+-]?\d+)\}\{([+-]?\d+)\}")
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?:\D|$))")

Number = Fraction | float


def _candidate(response: str) -> str:
    text = final_answer(response)
    return response if text is None else text


def normalize_text(text: str) -> str:
    """Lower-case, single-spaced, without surrounding math delimiters or a trailing full stop."""
    s = strip_math_delimiters(text)
    s = re.sub(r"\\text\{([^{}]*)\}", r"\1", s)
    return " ".join(s.split()).casefold()


def verify_exact(response: str, answer: str, metadata: dict) -> float:
    """1.0 when the normalised final answer equals the normalised reference answer."""
    return 1.0 if normalize_text(_candidate(response)) == normalize_text(str(answer)) else 0.0


def parse_number(text: str) -> Number | None:
    """The number written in ``text``, or None when it is not exactly one number."""
    s = strip_math_delimiters(str(text))
    s = s.replace("\\!", "").replace("\\,", "").replace("\\%", "").replace("%", "").replace("\\$", "")
    s = s.replace("$", "").replace(" ", "").replace("\u2212", "-")
    s = _THOUSANDS.sub("", s)
    if not s or len(s) > _MAX_NUMBER_CHARS:
        return None
    if _DECIMAL.fullmatch(s):
        return Fraction(s)
    if _SCIENTIFIC.fullmatch(s):
        value = float(s)
        return value if math.isfinite(value) else None
    for pattern in (_SLASH, _LATEX_FRAC):
        m = pattern.fullmatch(s)
        if m:
            sign, num, den = m.groups()
            if int(den) == 0:
                return None
            value = Fraction(int(num), int(den))
            return -value if sign == "-" else value
    return None


def numbers_match(a: Number, b: Number, rel_tol: float = 1e-6, abs_tol: float = 1e-9) -> bool:
    """Equal, or within the relative / absolute tolerance."""
    return a == b or math.isclose(float(a), float(b), rel_tol=rel_tol, abs_tol=abs_tol)


def verify_numeric(response: str, answer: str, metadata: dict) -> float:
    """1.0 when the final answer is a number equal to the reference (see module docstring)."""
    gold = parse_number(str(answer))
    if gold is None:
        raise ValueError(f"numeric verifier: reference answer {answer!r} is not a number")
    return _score(parse_number(_candidate(response)), gold, metadata)


def _score(pred: Number | None, gold: Number, metadata: dict) -> float:
    """1.0 when ``pred`` matches ``gold`` within the record's tolerances (``rel_tol``, ``abs_tol``)."""
    if pred is None:
        return 0.0
    rel_tol = float(metadata.get("rel_tol", 1e-6))
    abs_tol = float(metadata.get("abs_tol", 1e-9))
    return 1.0 if numbers_match(pred, gold, rel_tol, abs_tol) else 0.0


_LAST_NUMBER = re.compile(r"[+-]?\d[\d,]*(?:\.\d+)?")


def verify_last_number(response: str, answer: str, metadata: dict) -> float:
    """1.0 when the last number in the response equals the reference (tolerances as for ``numeric``)."""
    gold = parse_number(str(answer))
    if gold is None:
        raise ValueError(f"last_number verifier: reference answer {answer!r} is not a number")
    found = _LAST_NUMBER.findall(response[-4096:])
    return _score(parse_number(found[-1].rstrip(",")) if found else None, gold, metadata)


def check_numeric_record(answer: str, metadata: dict) -> None:
    """Raise ValueError when the reference answer is not a number."""
    if parse_number(str(answer)) is None:
        raise ValueError(f"the numeric verifier needs a number as answer, got {answer!r}")
    for key in ("rel_tol", "abs_tol"):
        if key in metadata:
            try:
                ok = float(metadata[key]) >= 0
            except (TypeError, ValueError):
                ok = False
            if not ok:
                raise ValueError(f"metadata {key!r} must be a non-negative number, got {metadata[key]!r}")


def check_exact_record(answer: str, metadata: dict) -> None:
    """Raise ValueError when the reference answer normalises to an empty string."""
    if not normalize_text(str(answer)):
        raise ValueError("the exact verifier needs a non-empty answer")


verify_numeric.check_record = check_numeric_record
verify_exact.check_record = check_exact_record
verify_last_number.check_record = check_numeric_record
