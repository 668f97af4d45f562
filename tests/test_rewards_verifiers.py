"""Verifiers as pure functions: answer extraction, math equivalence, exact / numeric match, countdown, registry."""

from __future__ import annotations

from fractions import Fraction

import pytest

from stare_lightning.rewards import get_verifier, known_verifiers
from stare_lightning.rewards.expr import ExpressionError, safe_eval
from stare_lightning.rewards.extract import answer_line, final_answer, last_boxed

CD = {"numbers": [3, 5, 7], "target": 22, "ops": "+-*"}


# -- extraction ----------------------------------------------------------------------------------


def test_last_boxed_balances_braces_and_takes_the_last():
    text = r"first \boxed{1} then \boxed{\frac{1}{2}} and \boxed{\frac{3}{\sqrt{4}}} done"
    assert last_boxed(text) == r"\frac{3}{\sqrt{4}}"
    assert last_boxed(r"set \boxed{\{1, 2\}}") == r"\{1, 2\}"
    assert last_boxed(r"\boxed{7} and an unclosed \boxed{8") == "7"
    assert last_boxed("no box here") is None


def test_answer_line_variants():
    assert answer_line("work...\nAnswer: 42\n") == "42"
    assert answer_line("**Final answer:** 7/2") == "7/2"
    assert answer_line("Answer: 1\nmore\nAnswer: 2") == "2"
    assert answer_line("the answer is clear") is None
    assert final_answer("Answer: \\boxed{5}") == "5"


# -- math ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "response, answer",
    [
        (r"so the result is \boxed{\frac{1}{2}}.", "0.5"),
        (r"\boxed{0.5}", r"\frac{1}{2}"),
        (r"\boxed{\dfrac{1}{2}}", "1/2"),
        ("Answer: 1/2", r"\frac12"),
        (r"\boxed{\frac{\sqrt{2}}{2}}", r"\frac{1}{\sqrt{2}}"),
        (r"\boxed{(x+1)^2}", "x^2+2x+1"),
        (r"\boxed{\{2, 1\}}", r"\{1,2\}"),
        (r"wrong \boxed{3} then fixed \boxed{4}", "4"),
        (r"\boxed{1,000}", "1000"),
        (r"\boxed{5}", r"\boxed{5}"),  # a boxed reference is unboxed
    ],
)
def test_math_accepts_equivalent_forms(response, answer):
    assert get_verifier("math")(response, answer, {}) == 1.0


@pytest.mark.parametrize(
    "response, answer",
    [
        (r"\boxed{0.51}", "0.5"),
        (r"\boxed{4} then \boxed{3}", "4"),  # only the last box counts
        ("0.5", "0.5"),  # no boxed answer and no Answer: line
        (r"\boxed{}", "0"),
        (r"\boxed{x^2+1}", "(x+1)^2"),
    ],
)
def test_math_rejects(response, answer):
    assert get_verifier("math")(response, answer, {}) == 0.0


# -- exact / numeric ---------------------------------------------------------------------------------


def test_exact_normalises():
    exact = get_verifier("exact")
    assert exact("  Yes. ", "yes", {}) == 1.0
    assert exact(r"\boxed{B}", "b", {}) == 1.0
    assert exact("New  York", "new york", {}) == 1.0
    assert exact("no", "yes", {}) == 0.0


@pytest.mark.parametrize(
    "response, answer, expected",
    [
        ("22", "22", 1.0),
        ("-4", "-4", 1.0),
        (r"\boxed{1,234}", "1234", 1.0),
        ("Answer: 0.5", "1/2", 1.0),
        (r"\frac{1}{2}", "0.5", 1.0),
        ("1e3", "1000", 1.0),
        ("3.0000001", "3", 1.0),  # within the default relative tolerance of 1e-6
        ("3.001", "3", 0.0),
        ("0.333", "1/3", 0.0),
        ("23", "22", 0.0),
        ("22 apples", "22", 0.0),
        ("", "22", 0.0),
        ("1e99999", "1", 0.0),
    ],
)
def test_numeric(response, answer, expected):
    assert get_verifier("numeric")(response, answer, {}) == expected


def test_numeric_tolerance_from_metadata():
    numeric = get_verifier("numeric")
    assert numeric("3.001", "3", {"abs_tol": 1e-2}) == 1.0
    assert numeric("3.1", "3", {"rel_tol": 0.01}) == 0.0


def test_numeric_refuses_a_reference_that_is_not_a_number():
    with pytest.raises(ValueError, match="not a number"):
        get_verifier("numeric")("1", "one", {})


# -- countdown -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "response",
    ["3*5+7", "7+5*3", "(3*5)+7", " 3*5+7\n", "3*5+7 = 22", r"\boxed{3 \times 5 + 7}", "I think...\nAnswer: $7+3*5$"],
)
def test_countdown_accepts(response):
    assert get_verifier("countdown")(response, "22", CD) == 1.0


@pytest.mark.parametrize(
    "response, why",
    [
        ("3*5+7+7", "reuses a number"),
        ("3*7+5*3", "reuses a number"),
        ("3*5+7-0", "uses a number that was not given"),
        ("5*3+7*1", "uses a number that was not given"),
        ("3*5", "misses a number"),
        ("3+5+7", "wrong value"),
        ("3*5*7", "wrong value"),
        ("__import__('os').system('true')", "unsafe code"),
        ("__import__('os')", "unsafe code"),
        ("(lambda: 22)()", "unsafe code"),
        ("3*5+7 if True else 0", "unsafe code"),
        ("3**2+5+7", "power"),
        ("0x3*5+7", "hex literal"),
        ("-3+5*7-... ", "garbage"),
        ("-(3-5*7)-7-... ", "garbage"),
        ("", "empty"),
        ("7*(5-3)+8/1", "not the given numbers"),
        ("(7+5)*3/1", "division not allowed and a fourth number"),
    ],
)
def test_countdown_rejects(response, why):
    assert get_verifier("countdown")(response, "22", CD) == 0.0, why


def test_countdown_division_and_zero_division():
    meta = {"numbers": [8, 4, 2], "target": 4, "ops": "+-*/"}
    verify = get_verifier("countdown")
    assert verify("8/4*2", "4", meta) == 1.0
    assert verify("8/(4/2)", "4", meta) == 1.0
    assert verify("8/(4-4)*2", "4", meta) == 0.0
    assert verify("8/4*2", "4", {**meta, "ops": "+-*"}) == 0.0
    assert verify("8/(2-2)", "0", {"numbers": [8, 2, 2], "target": 0}) == 0.0  # division by zero


def test_countdown_unary_minus_is_refused():
    assert get_verifier("countdown")("-3+5*7-10", "22", {"numbers": [3, 5, 7, 10], "target": 22}) == 0.0


def test_safe_eval_is_exact_and_refuses_code():
    assert safe_eval("7/2*2") == Fraction(7)
    assert safe_eval("(1+2)*3-4") == 5
    for bad in ["__import__('os')", "a+1", "2**10", "1.5+1", "[1]", "-1", "1 if 1 else 2", "9" * 300]:
        with pytest.raises(ExpressionError):
            safe_eval(bad)
    with pytest.raises(ZeroDivisionError):
        safe_eval("1/(2-2)")


# -- registry --------------------------------------------------------------------------------------


def test_unknown_verifier_lists_the_known_ones():
    with pytest.raises(ValueError) as info:
        get_verifier("mathh")
    message = str(info.value)
    assert "mathh" in message
    for name in ("countdown", "exact", "math", "numeric"):
        assert name in message
    assert known_verifiers() == ["countdown", "exact", "last_number", "math", "numeric", "reasoning_gym"]


def test_user_verifier_by_name(tmp_path, monkeypatch):
    (tmp_path / "my_rewards_mod.py").write_text("def half(response, answer, metadata):\n    return 0.5\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    tmp_path.chmod(0o755)  # the verifier worker runs as a uid of its own
    assert get_verifier("my_rewards_mod:half")("x", "y", {}) == 0.5
    with pytest.raises(ValueError, match="no attribute"):
        get_verifier("my_rewards_mod:missing")
    with pytest.raises(ValueError, match="cannot import"):
        get_verifier("no_such_module_xyz:fn")


@pytest.mark.parametrize("name", ["os:system", "builtins:eval", "subprocess:getoutput"])
def test_standard_library_functions_are_not_verifiers(name):
    with pytest.raises(ValueError, match="standard library"):
        get_verifier(name)


@pytest.mark.parametrize(
    "response, answer, expected",
    [
        ("7 + 7 is 14.", "14", 1.0),
        ("The answer is 12. Wait, 7 + 7 = 14", "14", 1.0),
        ("7 + 7 = 14, not 12", "14", 0.0),  # the last number decides
        ("So 3 - 5 = -2", "-2", 1.0),
        ("The total is 1,234.", "1234", 1.0),
        ("\\boxed{8}", "8", 1.0),
        ("no digits here", "3", 0.0),
        ("", "3", 0.0),
    ],
)
def test_last_number(response, answer, expected):
    assert get_verifier("last_number")(response, answer, {}) == expected


def test_last_number_refuses_a_reference_that_is_not_a_number():
    from stare_lightning.rewards.registry import check_record

    with pytest.raises(ValueError, match="needs a number as answer"):
        check_record("last_number", "seven", {})
