"""The calculator against independent references (exact Fractions on generated trees; Python's own integer
arithmetic on generated flat expressions), and what it refuses, each refusal one line (how fast:
``benchmarks/bench_tools.py --refusals``)."""

from __future__ import annotations

import random
from fractions import Fraction

import pytest

from stare_lightning.tools.calculator import MAX_DIGITS, Calculator

CALC = Calculator()


def _expected_text(value: Fraction) -> str:
    """How the calculator documents its printing: an integer as an integer, else the nearest float."""
    return str(value.numerator) if value.denominator == 1 else repr(float(value))


def _tree(rng: random.Random, depth: int) -> str:
    """A fully parenthesised random expression: integer and decimal literals, every operator, unary minus."""
    if depth == 0 or rng.random() < 0.3:
        number = str(rng.randint(0, 30))
        return f"{number}.{rng.randint(0, 99)}" if rng.random() < 0.2 else number
    op = rng.choice(["+", "-", "*", "/", "//", "%", "**", "neg"])
    left = _tree(rng, depth - 1)
    if op == "neg":
        return f"(-{left})"
    if op == "**":
        return f"({left} ** {rng.randint(-2, 3)})"
    return f"({left} {op} {_tree(rng, depth - 1)})"


def _reference(text: str) -> Fraction | None:
    """An independent exact evaluator of ``_tree``'s grammar (None: it divides by zero), written for this test."""
    tokens = text.replace("(", " ( ").replace(")", " ) ").split()

    def expr(i: int) -> tuple[Fraction | None, int]:
        if tokens[i] != "(":
            return Fraction(tokens[i]), i + 1  # a decimal literal is the decimal written
        if tokens[i + 1] == "-":
            value, j = expr(i + 2)
            return (None if value is None else -value), j + 1
        left, j = expr(i + 1)
        op = tokens[j]
        if op == ")":
            return left, j + 1
        if op == "**":
            exponent = int(tokens[j + 1])
            ok = left is not None and not (left == 0 and exponent < 0)
            return (left**exponent if ok else None), j + 3
        right, k = expr(j + 1)
        if left is None or right is None or (right == 0 and op in ("/", "//", "%")):
            return None, k + 1
        ops = {"+": lambda: left + right, "-": lambda: left - right, "*": lambda: left * right,
               "/": lambda: left / right, "//": lambda: Fraction(left // right), "%": lambda: left % right}  # fmt: skip
        return ops[op](), k + 1

    return expr(0)[0]


@pytest.mark.parametrize("seed", range(4))
def test_random_expressions_match_an_exact_reference(seed):
    rng = random.Random(seed)
    for _ in range(150):
        text = _tree(rng, rng.randint(1, 4))
        value = _reference(text)
        result = CALC.run(text)
        if value is None:
            assert not result.ok and result.text.startswith("ZeroDivisionError"), (text, result)
        elif max(abs(value.numerator), value.denominator).bit_length() > 3000:
            assert not result.ok and "digits" in result.text, (text, result)
        else:
            assert result.ok and result.text == _expected_text(value), (text, value, result)


def _flat(rng: random.Random) -> str:
    """An integer expression without parentheses (precedence and unary minus as Python has them), no ``/``."""
    parts = [rng.choice(["", "-", "+"]) + str(rng.randint(0, 12))]
    for _ in range(rng.randint(1, 6)):
        op = rng.choice(["+", "-", "*", "//", "%", "**"])
        operand = str(rng.randint(0, 3)) if op == "**" else rng.choice(["", "-"]) + str(rng.randint(0, 12))
        parts += [op, operand]
    return " ".join(parts)


def test_flat_integer_expressions_match_python():
    rng = random.Random(7)
    for _ in range(400):
        text = _flat(rng)
        try:
            expected = eval(text, {"__builtins__": {}})  # the test's own generated integer arithmetic only
        except ZeroDivisionError:
            expected = None
        result = CALC.run(text)
        if expected is None:
            assert not result.ok and result.text.startswith("ZeroDivisionError"), (text, result)
        else:
            assert result.ok and result.text == str(expected), (text, expected, result)


@pytest.mark.parametrize(
    ("expression", "text"),
    [("7/2", "3.5"), ("1/3", repr(1 / 3)), ("0.1 + 0.2", "0.3"), ("2.5 * 2", "5"), ("-7 // 2", "-4"),
     ("-7 % 3", "2"), ("2 ** -2", "0.25"), ("2 ** 0.5", repr(2**0.5)), ("  (3 + 4) * 5\n", "35"),
     ("1e-3 * 1000", "1"), ("10 ** 999 // 10 ** 998", "10")],
)  # fmt: skip
def test_documented_printing(expression, text):
    result = CALC.run(expression)
    assert result.ok and result.text == text


@pytest.mark.parametrize(
    ("expression", "kind"),
    [
        ("x + 1", "ValueError"),
        ("(1).real", "ValueError"),
        ("abs(-3)", "ValueError"),
        ("lambda: 1", "ValueError"),
        ("__import__('os').system('true')", "ValueError"),
        ("[i for i in range(10)]", "ValueError"),
        ("(i for i in range(10))", "ValueError"),
        ("'a' * 3", "ValueError"),
        ("True + 1", "ValueError"),
        ("1j * 2", "ValueError"),
        ("1 if 2 else 3", "ValueError"),
        ("1 < 2", "ValueError"),
        ("2 ** 10 ** 10", "OverflowError"),
        ("9 ** 9 ** 9", "OverflowError"),
        ("10 ** 5000", "OverflowError"),
        ("(10 ** 600) * (10 ** 600)", "OverflowError"),
        ("1e100000000", "OverflowError"),
        ("1 / 0", "ZeroDivisionError"),
        ("5 // (2 - 2)", "ZeroDivisionError"),
        ("5 % 0", "ZeroDivisionError"),
        ("0 ** -1", "ZeroDivisionError"),
        ("(-8) ** 0.5", "ValueError"),
        ("3 +", "SyntaxError"),
        ("", "SyntaxError"),
        ("import os", "SyntaxError"),
        ("(" * 300 + "1" + ")" * 300, "SyntaxError"),  # the parser's nesting limit
        ("1" + "+1" * 600, "ValueError"),  # longer than the expression limit
    ],
)
def test_refusals_are_one_line_errors(expression, kind):
    result = CALC.run(expression)
    assert not result.ok and result.text.startswith(f"{kind}: ") and "\n" not in result.text, result


def test_long_chains_within_the_length_limit_work():
    assert CALC.run("-" * 990 + "1").text == "1"
    assert CALC.run("+".join(["1"] * 500)).text == "500"
    assert CALC.run("-(" * 150 + "2" + ")" * 150).text == "2"


def test_results_stay_within_the_digit_bound_and_the_output_limit():
    assert CALC.run(f"10 ** {MAX_DIGITS - 1}").ok
    assert not CALC.run(f"10 ** {MAX_DIGITS}").ok
    short = Calculator(max_output_chars=10).run("10 ** 50")
    assert short.ok and short.text.startswith("1" + "0" * 9) and short.text.endswith("[output truncated]")
    with pytest.raises(ValueError, match="max_output_chars"):
        Calculator(max_output_chars=0)


def test_history_is_ignored():
    assert CALC.run("2 * 3", history=["x = 4"]).text == "6"
