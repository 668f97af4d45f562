"""The calculator tool: exact arithmetic on numbers with ``+ - * / // % **`` and parentheses, never ``eval``.

The expression is parsed with ``ast.parse(mode="eval")`` and its tree walked, allowing only int and float
literals, the binary operators above and unary ``+``/``-``; anything else (names, calls, attributes, ...) is
refused. Arithmetic is exact, on ``fractions.Fraction`` (a decimal literal such as ``0.1`` is read as exactly 1/10);
only a fractional power (``2 ** 0.5``) goes through a float.

Printing: an integer value prints as an integer (``7/7`` gives ``1``, ``2.5 * 2`` gives ``5``); any other value as
Python prints a float, the nearest double (``7/2`` gives ``3.5``, ``1/3`` gives ``0.3333333333333333``), which is
what ``print(expr)`` shows in the Python tool; a non-integer too large or too small for a float prints as a reduced
fraction ``p/q``. Every refusal is ``ok=False`` with a one-line message: ``SyntaxError`` for what does not parse,
``ValueError`` for what is not arithmetic, ``ZeroDivisionError``, and ``OverflowError`` for exponents over
``MAX_EXPONENT`` and for values over ``MAX_DIGITS`` digits (checked before a power is computed, and after every
operation), which keep each call to microseconds.
"""

from __future__ import annotations

import ast
import math
import time
from collections.abc import Callable, Sequence
from decimal import Decimal, InvalidOperation
from fractions import Fraction

from stare_lightning.tools.base import ToolResult, clip_text

__all__ = ["Calculator", "CalculatorError", "evaluate_expression", "format_value"]

MAX_EXPRESSION_CHARS = 1000
MAX_DIGITS = 1000  # of a numerator or denominator, at any step
MAX_EXPONENT = 10_000
_MAX_BITS = int(MAX_DIGITS / math.log10(2)) + 1

_BINARY: dict[type, Callable[[Fraction, Fraction], Fraction]] = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b,
    ast.FloorDiv: lambda a, b: Fraction(a // b),
    ast.Mod: lambda a, b: a % b,
}
# What a refused node is called in the message.
_REFUSED_NAMES = {
    ast.Name: "a name",
    ast.Attribute: "attribute access",
    ast.Call: "a function call",
    ast.Lambda: "a lambda",
    ast.Subscript: "indexing",
    ast.Compare: "a comparison",
    ast.BoolOp: "a boolean operator",
    ast.IfExp: "a conditional expression",
    ast.ListComp: "a comprehension",
    ast.SetComp: "a comprehension",
    ast.DictComp: "a comprehension",
    ast.GeneratorExp: "a comprehension",
}
ALLOWED = "numbers, + - * / // % ** and parentheses"


class CalculatorError(Exception):
    """A refused expression; ``kind`` names it for the model (SyntaxError, ValueError, ...)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind

    def __str__(self) -> str:
        return f"{self.kind}: {self.args[0]}"


def _too_long(number: int) -> bool:
    bits = abs(number).bit_length()
    return bits > _MAX_BITS or (bits > _MAX_BITS - 4 and len(str(abs(number))) > MAX_DIGITS)  # exact at the edge


def _checked(value: Fraction) -> Fraction:
    if _too_long(value.numerator) or _too_long(value.denominator):
        raise CalculatorError("OverflowError", f"a value has more than {MAX_DIGITS} digits")
    return value


def _literal(node: ast.Constant, source: str) -> Fraction:
    value = node.value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise CalculatorError("ValueError", f"{value!r} is not a number: only {ALLOWED} are allowed")
    if isinstance(value, int):
        return _checked(Fraction(value))
    text = (ast.get_source_segment(source, node) or repr(value)).replace("_", "")
    try:
        written = Decimal(text)  # the decimal the policy wrote, exactly (1e-3 is 1/1000)
    except InvalidOperation:
        written = Decimal(repr(value))
    if not written.is_finite() or abs(written.adjusted()) > MAX_DIGITS:  # checked before 10**exponent is built
        raise CalculatorError("OverflowError", f"{text} has more than {MAX_DIGITS} digits")
    return _checked(Fraction(written))


def _power(base: Fraction, exponent: Fraction) -> Fraction:
    if exponent.denominator != 1:  # a fractional power: through a float
        if base < 0:
            raise CalculatorError("ValueError", "a negative number to a fractional power is not a real number")
        try:
            return _checked(Fraction(float(base) ** float(exponent)))
        except (OverflowError, ValueError) as err:
            raise CalculatorError("OverflowError", f"the power is too large ({err})") from None
    if abs(exponent) > MAX_EXPONENT:
        raise CalculatorError("OverflowError", f"exponent {exponent} is too large (at most {MAX_EXPONENT})")
    if base == 0 and exponent < 0:
        raise CalculatorError("ZeroDivisionError", "0 cannot be raised to a negative power")
    largest = max(abs(base.numerator), base.denominator)
    # A lower bound of the result's size, so the power is never built when it is surely too large (within
    # a factor of 2 of the bound otherwise, then checked exactly).
    if abs(exponent) * (largest.bit_length() - 1) > _MAX_BITS:
        raise CalculatorError("OverflowError", f"the power has more than {MAX_DIGITS} digits")
    return _checked(base ** int(exponent))


def _walk(node: ast.AST, source: str) -> Fraction:
    if isinstance(node, ast.Expression):
        return _walk(node.body, source)
    if isinstance(node, ast.Constant):
        return _literal(node, source)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        negative = False
        while isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):  # a loop: "----1"
            negative ^= isinstance(node.op, ast.USub)
            node = node.operand
        value = _walk(node, source)
        return -value if negative else value
    if isinstance(node, ast.BinOp) and (type(node.op) in _BINARY or isinstance(node.op, ast.Pow)):
        left, right = _walk(node.left, source), _walk(node.right, source)
        if isinstance(node.op, ast.Pow):
            return _power(left, right)
        if right == 0 and isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)):
            raise CalculatorError("ZeroDivisionError", "division by zero")
        return _checked(_BINARY[type(node.op)](left, right))
    what = _REFUSED_NAMES.get(type(node), f"'{type(node).__name__}'")
    raise CalculatorError("ValueError", f"{what} is not allowed: only {ALLOWED} are allowed")


def evaluate_expression(expression: str) -> Fraction:
    """The exact value of ``expression``; raises ``CalculatorError`` for anything refused."""
    expression = expression.strip()
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError("ValueError", f"the expression is longer than {MAX_EXPRESSION_CHARS} characters")
    if not expression:
        raise CalculatorError("SyntaxError", "the expression is empty")
    try:
        tree = ast.parse(expression, mode="eval")
    except SyntaxError as err:
        raise CalculatorError("SyntaxError", err.msg) from None
    except (ValueError, MemoryError, RecursionError) as err:  # null bytes, a parser stack overflow
        raise CalculatorError("SyntaxError", str(err) or type(err).__name__) from None
    try:
        return _walk(tree, expression)
    except RecursionError:
        raise CalculatorError("ValueError", "the expression is nested too deeply") from None


def format_value(value: Fraction) -> str:
    """An integer as an integer, anything else as Python prints the nearest float (``p/q`` where no float can)."""
    if value.denominator == 1:
        return str(value.numerator)
    try:
        approx = float(value)
    except OverflowError:
        return f"{value.numerator}/{value.denominator}"
    return repr(approx) if approx != 0.0 else f"{value.numerator}/{value.denominator}"


class Calculator:
    """The ``calculator`` tool (stateless: ``history`` is ignored)."""

    name = "calculator"
    argument = "expression"
    description = "Evaluate an arithmetic expression exactly (numbers, + - * / // % ** and parentheses)."
    argument_description = "An arithmetic expression, e.g. (3 + 4) * 5 / 2"

    def __init__(self, max_output_chars: int = 1024) -> None:
        if max_output_chars < 1:
            raise ValueError(f"max_output_chars={max_output_chars} is out of range: must be an integer >= 1")
        self.max_output_chars = max_output_chars

    def run(self, call: str, *, history: Sequence[str] = ()) -> ToolResult:
        started = time.perf_counter()
        try:
            text, ok = format_value(evaluate_expression(call)), True
        except CalculatorError as err:
            text, ok = str(err), False
        return ToolResult(text=clip_text(text, self.max_output_chars), ok=ok, seconds=time.perf_counter() - started)

    def close(self) -> None:
        pass
