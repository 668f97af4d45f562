"""Pull the final answer out of a model response: the last ``\\boxed{...}`` or an ``Answer:`` line.

Verifiers share these helpers so that every one of them reads a response the same way. Brace matching
is done by hand (regular expressions cannot balance braces), skipping backslash-escaped braces such as
``\\{1, 2\\}``.
"""

from __future__ import annotations

import re

_BOX_OPEN = re.compile(r"\\(?:boxed|fbox)\s*\{")
# "Answer: 42", "Final answer: 42", "**Answer:** 42", "## Answer: 42" on a line of its own.
_ANSWER_LINE = re.compile(
    r"^[ \t>#*_-]*(?:the\s+)?(?:final\s+)?answer\s*(?:is)?\s*[*_]*\s*[:\uff1a]\s*[*_]*\s*(?P<ans>.*?)\s*$",
    re.IGNORECASE | re.MULTILINE,
)


def _closing_brace(text: str, start: int) -> int | None:
    """Index just past the ``}`` that closes the group opened right before ``start``; None if unclosed."""
    depth = 1
    i = start
    n = len(text)
    while i < n:
        c = text[i]
        if c == "\\":
            i += 2  # skip the escaped character, so \{ and \} never count
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return None


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) whose braces balance; None if there is none."""
    for match in reversed(list(_BOX_OPEN.finditer(text))):
        end = _closing_brace(text, match.end())
        if end is not None:
            return text[match.end() : end - 1].strip()
    return None


def answer_line(text: str) -> str | None:
    """What follows the last ``Answer:`` line (``Final answer:``, markdown bold allowed); None if absent."""
    found = None
    for match in _ANSWER_LINE.finditer(text):
        ans = match.group("ans").strip().strip("*_").strip()
        if ans:
            found = ans
    return found


def final_answer(text: str) -> str | None:
    """The last boxed answer if the response has one, else the last ``Answer:`` line, else None."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    return answer_line(text)


def strip_math_delimiters(text: str) -> str:
    """Remove surrounding ``$...$``, ``\\(...\\)``, ``\\[...\\]`` and a trailing full stop."""
    s = text.strip()
    changed = True
    while changed and s:
        changed = False
        for left, right in (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
            if len(s) >= len(left) + len(right) and s.startswith(left) and s.endswith(right):
                s = s[len(left) : len(s) - len(right)].strip()
                changed = True
                break
        if s.endswith(".") and not s.endswith(".."):
            s = s[:-1].rstrip()
            changed = True
    return s
