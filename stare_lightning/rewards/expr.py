"""A safe evaluator for small integer arithmetic: ``+ - * /``, parentheses and non-negative integer literals.

Nothing is ever passed to ``eval``. The text is first checked character by character (digits, the
allowed operators, parentheses, spaces), then parsed with :mod:`ast` and walked node by node; any node
other than a binary operation or an integer literal is refused. Evaluation is exact (``fractions.Fraction``),
so ``7/2*2`` equals 7 and no float rounding decides a reward. Unary minus is refused on purpose: in the
countdown game every number must be used as given.
"""

from __future__ import annotations

import ast
from fractions import Fraction

MAX_EXPRESSION_CHARS = 256
_OPS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/"}


class ExpressionError(ValueError):
    """The text is not an allowed arithmetic expression."""


def parse_expression(text: str, ops: str = "+-*/") -> ast.expr:
    """Parse ``text`` into an AST that holds only the operators in ``ops`` and integer literals.

    Raises ExpressionError for anything else (names, calls, attributes, powers, floats, unary signs,
    over-long input).
    """
    if not isinstance(text, str):
        raise ExpressionError(f"expected a string, got {type(text).__name__}")
    if len(text) > MAX_EXPRESSION_CHARS:
        raise ExpressionError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    allowed_chars = set("0123456789() \t") | set(ops)
    bad = sorted({c for c in text if c not in allowed_chars})
    if bad:
        raise ExpressionError(f"characters not allowed: {''.join(bad)!r} (allowed operators: {ops})")
    if "**" in text or "//" in text:
        raise ExpressionError("'**' and '//' are not allowed")
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        raise ExpressionError(f"not a valid expression ({type(exc).__name__})") from None
    for node in ast.walk(tree):
        if isinstance(node, (ast.Expression, ast.BinOp)):
            if isinstance(node, ast.BinOp) and _OPS.get(type(node.op)) not in set(ops):
                raise ExpressionError(f"operator {type(node.op).__name__} not allowed (allowed: {ops})")
            continue
        if isinstance(node, tuple(_OPS)):
            continue
        if isinstance(node, ast.Constant) and type(node.value) is int:
            continue
        raise ExpressionError(f"syntax not allowed: {type(node).__name__}")
    return tree.body


def int_literals(node: ast.expr) -> list[int]:
    """The integer literals of a parsed expression, left to right."""
    if isinstance(node, ast.Constant):
        return [node.value]
    assert isinstance(node, ast.BinOp)
    return int_literals(node.left) + int_literals(node.right)


def evaluate(node: ast.expr) -> Fraction:
    """Exact value of a parsed expression. Raises ZeroDivisionError on division by zero."""
    if isinstance(node, ast.Constant):
        return Fraction(node.value)
    assert isinstance(node, ast.BinOp)
    left = evaluate(node.left)
    right = evaluate(node.right)
    op = type(node.op)
    if op is ast.Add:
        return left + right
    if op is ast.Sub:
        return left - right
    if op is ast.Mult:
        return left * right
    if op is ast.Div:
        return left / right
    raise ExpressionError(f"operator {op.__name__} not allowed")  # unreachable after parse_expression


def safe_eval(text: str, ops: str = "+-*/") -> Fraction:
    """Parse and evaluate in one call (ExpressionError or ZeroDivisionError on bad input)."""
    return evaluate(parse_expression(text, ops))
