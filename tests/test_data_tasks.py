"""Built-in tasks: deterministic disjoint splits, correct solutions and answers, prompt formats, SFT pairs."""

from __future__ import annotations

import itertools
import re
import statistics

import pytest

from stare_lightning.data import build_records, sft_examples
from stare_lightning.data.tasks import countdown
from stare_lightning.rewards import get_verifier


def problem_key(record):
    return tuple(sorted(record.metadata["numbers"])), record.metadata["target"]


@pytest.fixture(scope="module")
def cd_train():
    return build_records("countdown", "train", 3000, seed=7)


@pytest.fixture(scope="module")
def cd_val():
    return build_records("countdown", "val", 0, seed=7)


def test_countdown_is_deterministic_and_seeded(cd_train, cd_val):
    assert build_records("countdown", "train", 3000, seed=7) == cd_train
    assert build_records("countdown", "val", 0, seed=7) == cd_val
    assert build_records("countdown", "val", 0, seed=8) != cd_val
    # the validation split does not depend on the training size
    assert build_records("countdown", "val", 0, seed=7) == build_records("countdown", "val", 5, seed=7)


def test_countdown_splits_are_disjoint(cd_train, cd_val):
    assert len(cd_val) == 64 and len(cd_train) == 3000
    val_keys = {problem_key(r) for r in cd_val}
    assert len(val_keys) == 64  # no duplicate in validation
    assert not val_keys & {problem_key(r) for r in cd_train}
    assert len({r.id for r in cd_train}) == 3000


def brute_force_values(numbers):
    """Independent check: every value of every fully parenthesised expression over the numbers (+ - *)."""

    def values(nums):
        if len(nums) == 1:
            return {nums[0]}
        out = set()
        for i in range(1, len(nums)):
            for a in values(nums[:i]):
                for b in values(nums[i:]):
                    out |= {a + b, a - b, a * b}
        return out

    found = set()
    for perm in itertools.permutations(numbers):
        found |= values(list(perm))
    return found


def test_countdown_solutions_are_correct_and_plentiful(cd_train, cd_val):
    verify = get_verifier("countdown")
    for r in cd_val + cd_train[:300]:
        meta = r.metadata
        assert set(meta) >= {"numbers", "target", "solution", "num_solutions", "num_forms"}
        assert len(meta["numbers"]) == 3 and all(1 <= n <= 9 for n in meta["numbers"])
        assert meta["target"] in brute_force_values(meta["numbers"])
        assert verify(meta["solution"], r.answer, meta) == 1.0
        all_solutions = countdown.solutions(tuple(sorted(meta["numbers"])), "+-*")[meta["target"]]
        assert len(all_solutions) == meta["num_solutions"] >= 4
        assert all(verify(s, r.answer, meta) == 1.0 for s in all_solutions)
        assert meta["solution"] in all_solutions
    mean = statistics.mean(r.metadata["num_solutions"] for r in cd_train)
    assert mean > 5.0  # measured: 5.28 distinct solution strings per prompt

    # solutions are drawn at random among the correct ones, not always the first in sorted order
    def first_in_order(r):
        return countdown.solutions(tuple(sorted(r.metadata["numbers"])), "+-*")[r.metadata["target"]][0]

    firsts = [r.metadata["solution"] == first_in_order(r) for r in cd_train[:500]]
    assert 0.05 < sum(firsts) / len(firsts) < 0.6


def test_countdown_forms():
    assert countdown.canonical_form("3*5+7") == countdown.canonical_form("7+5*3")
    assert countdown.canonical_form("9-(3-5)") == countdown.canonical_form("9+5-3")
    assert countdown.canonical_form("2*3+4") != countdown.canonical_form("3*4-2")
    strict = build_records("countdown", "val", 0, seed=1, val_size=20, min_forms=2)
    assert all(r.metadata["num_forms"] >= 2 for r in strict)


def test_countdown_prompt_styles(cd_train):
    r = cd_train[0]
    numbers, target = r.metadata["numbers"], r.metadata["target"]
    assert r.prompt == " ".join(map(str, numbers)) + f" -> {target}:"
    assert re.fullmatch(r"\d( \d){2} -> \d+:", r.prompt) and r.messages is None
    instruct = build_records("countdown", "train", 5, seed=7, style="instruct")
    for plain, chat in zip(cd_train[:5], instruct):
        assert chat.prompt is None and chat.metadata["style"] == "instruct"
        assert chat.metadata["numbers"] == plain.metadata["numbers"]  # same problems in both styles
        text = chat.messages[0]["content"]
        assert chat.messages[0]["role"] == "user" and "\\boxed{}" in text and str(chat.metadata["target"]) in text
        verify = get_verifier("countdown")
        assert verify(f"so \\boxed{{{chat.metadata['solution']}}}", chat.answer, chat.metadata) == 1.0


def test_countdown_settings():
    four = build_records("countdown", "val", 0, seed=3, val_size=8, num_numbers=4, min_number=2, max_number=12)
    assert all(len(r.metadata["numbers"]) == 4 and all(2 <= n <= 12 for n in r.metadata["numbers"]) for r in four)
    with pytest.raises(ValueError, match="unknown keys \\['digits'\\]"):
        build_records("countdown", "train", 1, digits=2)
    with pytest.raises(ValueError, match="min_number <= max_number"):
        build_records("countdown", "train", 1, min_number=5, max_number=2)
    with pytest.raises(ValueError, match="only .* distinct problems"):
        build_records("countdown", "val", 0, val_size=100, min_forms=3)


def test_arithmetic():
    train = build_records("arithmetic", "train", 500, seed=3, num_operands=3, digits=2)
    val = build_records("arithmetic", "val", 0, seed=3, num_operands=3, digits=2, val_size=50)
    assert not {r.metadata["expression"] for r in train} & {r.metadata["expression"] for r in val}
    verify = get_verifier("numeric")
    for r in train[:100] + val:
        expr = r.metadata["expression"]
        assert re.fullmatch(r"\d\d[+\-*]\d\d[+\-*]\d\d", expr)
        assert int(r.answer) == eval(expr)  # test-only cross-check on a string of digits and + - *
        assert r.prompt == expr + "=" and r.verifier == "numeric"
        assert verify(r.answer, r.answer, r.metadata) == 1.0
    chat = build_records("arithmetic", "val", 0, seed=3, style="instruct", val_size=3)
    assert "\\boxed{}" in chat[0].messages[0]["content"] and chat[0].prompt is None
    with pytest.raises(ValueError, match="ops"):
        build_records("arithmetic", "train", 1, ops="+/")


def test_sft_examples(cd_train):
    pairs = sft_examples(cd_train[:10])
    assert pairs == [(r.prompt, r.metadata["solution"]) for r in cd_train[:10]]
    arith = build_records("arithmetic", "train", 3, seed=1)
    assert sft_examples(arith) == [(r.prompt, r.answer) for r in arith]
    with pytest.raises(ValueError, match="plain-style"):
        sft_examples(build_records("countdown", "train", 2, style="instruct"))


def test_arithmetic_in_prose_for_small_chat_models():
    records = build_records(
        "arithmetic",
        "train",
        20,
        style="instruct",
        seed=1,
        num_operands=2,
        digits=1,
        ops="+",
        answer_format="last_number",
    )
    first = records[0]
    assert first.verifier == "last_number" and "boxed" not in first.messages[0]["content"]
    a, b = first.metadata["expression"].split("+")
    assert first.messages[0]["content"] == f"What is {a} + {b}?"
    verify = get_verifier("last_number")
    assert all(verify(f"{r.metadata['expression']} makes {r.answer}.", r.answer, r.metadata) == 1.0 for r in records)
    with pytest.raises(ValueError, match="prompt_style=instruct only"):
        build_records("arithmetic", "train", 2, style="plain", answer_format="last_number")
    with pytest.raises(ValueError, match="answer_format must be one of"):
        build_records("arithmetic", "train", 2, style="instruct", answer_format="free")
