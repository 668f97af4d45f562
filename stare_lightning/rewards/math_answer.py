"""The ``math`` verifier: last ``\\boxed{}`` (or ``Answer:`` line), then equivalence through math-verify.

The candidate answer is parsed as ``\\boxed{candidate}`` and the reference as ``$reference$`` (a reference
that is itself boxed is unboxed first); ``math_verify.verify`` then decides symbolic / numeric equivalence
(``\\frac{1}{2}`` = ``0.5``, ``(x+1)^2`` = ``x^2+2x+1``, sets, intervals). When math-verify cannot parse
one side or says no, a normalised string comparison gets the last word, so plain-text answers (``Yes``,
``(B)``) still match. A response without a boxed answer or an ``Answer:`` line scores 0.

math-verify guards itself with ``signal.alarm``, which only works in a process's main thread: the
verifier passes its own timeouts there (the ``VerifierPool`` worker runs it in its main thread) and
none elsewhere. Either way the hard limit is the pool's: call this through ``VerifierPool``, never in
the training loop directly, since sympy can spend minutes on inputs such as ``9^{9^{9^{9}}}``.
"""

from __future__ import annotations

import logging
import re
import threading

from .basic import normalize_text
from .extract import final_answer, last_boxed

INNER_TIMEOUT_S = 3  # math-verify's own alarm (whole seconds), below the pool's default of 5 s
_LATEX_NOISE = re.compile(r"\\left|\\right|\\!|\\,|\\;|\\:|\\displaystyle")


def _string_form(text: str) -> str:
    s = _LATEX_NOISE.sub("", text)
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = normalize_text(s)
    return s.replace(" ", "")


def _timeouts() -> int | None:
    if threading.current_thread() is threading.main_thread():
        return INNER_TIMEOUT_S
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # silence its "timeout disabled" warning
    return None


def verify_math(response: str, answer: str, metadata: dict) -> float:
    """1.0 when the final answer of ``response`` is mathematically equivalent to ``answer``."""
    candidate = final_answer(response)
    if candidate is None or not candidate.strip():
        return 0.0
    reference = str(answer).strip()
    boxed_reference = last_boxed(reference)
    if boxed_reference is not None:
        reference = boxed_reference
    if _string_form(candidate) == _string_form(reference):
        return 1.0

    from math_verify import parse, verify

    timeout = _timeouts()
    gold = parse(f"${reference}$", parsing_timeout=timeout)
    if not gold:
        gold = parse(f"\\boxed{{{reference}}}", parsing_timeout=timeout)
    pred = parse(f"\\boxed{{{candidate}}}", parsing_timeout=timeout)
    if not pred:
        pred = parse(f"${candidate}$", parsing_timeout=timeout)
    if gold and pred and verify(gold, pred, timeout_seconds=timeout):
        return 1.0
    return 0.0


def check_math_record(answer: str, metadata: dict) -> None:
    """Raise ValueError when the reference answer is empty."""
    if not str(answer).strip():
        raise ValueError("the math verifier needs a non-empty answer")


def _warmup() -> None:
    """Import math-verify and its parsers once, so the first scored call is not charged for it."""
    verify_math("\\boxed{\\frac{1}{2}}", "0.5", {})


verify_math.check_record = check_math_record
verify_math.warmup = _warmup
