"""Arithmetic: evaluate an integer expression such as ``7+3*5``; the answer is the integer (verifier ``numeric``).

Difficulty is set by the number of operands and their digit count (``digits=1``: 1..9, ``digits=2``:
10..99, ...); operators are drawn from ``ops`` (a subset of ``+-*``, so answers are integers; usual
precedence, no parentheses). Answers come from the safe evaluator, never from ``eval``.

Splits are deterministic and disjoint: validation expressions are drawn first from their own seeded
stream, and the training stream skips every one of them (training may repeat its own expressions when
the space is small).

Prompt styles: plain ``"7+3*5="`` with the response ``"22"`` then EOS; instruct, one user message. With
``answer_format="boxed"`` it asks for the value within ``\\boxed{}`` (verifier ``numeric``); with
``answer_format="last_number"`` it only asks the question, and the last number of the response is the
answer (verifier ``last_number``): small chat models such as SmolLM2-135M answer in prose and ignore the
box instruction.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, fields

from ...rewards.expr import safe_eval
from ..records import PromptRecord
from .splits import DisjointSplits

VERIFIERS = {"boxed": "numeric", "last_number": "last_number"}  # answer_format -> verifier
_SPLITS = DisjointSplits("arithmetic", "expression", "raise num_operands or digits, or lower data.val_size")


@dataclass(frozen=True)
class ArithmeticParams:
    """Settings of the arithmetic generator (``data.task_kwargs``)."""

    num_operands: int = 3
    digits: int = 1
    ops: str = "+-*"
    answer_format: str = "boxed"  # boxed | last_number (instruct style; see the module docstring)

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "answer_format":
                if value not in VERIFIERS:
                    raise ValueError(f"data.task_kwargs.answer_format must be one of {list(VERIFIERS)}, got {value!r}")
            elif f.name == "ops":
                if not isinstance(value, str) or not value or set(value) - set("+-*") or len(set(value)) != len(value):
                    raise ValueError(
                        f"data.task_kwargs.ops must be a string of distinct characters from '+-*', got {value!r}"
                    )
            elif type(value) is not int:
                raise ValueError(f"data.task_kwargs.{f.name} must be an int, got {value!r}")
        if not 2 <= self.num_operands <= 8:
            raise ValueError(f"data.task_kwargs.num_operands must be in 2..8, got {self.num_operands}")
        if not 1 <= self.digits <= 6:
            raise ValueError(f"data.task_kwargs.digits must be in 1..6, got {self.digits}")


def _draw(rng: random.Random, params: ArithmeticParams) -> str:
    lo, hi = 10 ** (params.digits - 1), 10**params.digits - 1
    text = str(rng.randint(lo, hi))
    for _ in range(params.num_operands - 1):
        text += rng.choice(params.ops) + str(rng.randint(lo, hi))
    return text


def plain_prompt(expression: str) -> str:
    """``"7+3*5="``"""
    return f"{expression}="


def instruct_message(expression: str, answer_format: str = "boxed") -> str:
    """The user message of the instruct style."""
    if answer_format == "last_number":
        return f"What is {expression.replace('+', ' + ').replace('-', ' - ').replace('*', ' * ')}?"
    return f"What is the value of {expression}? Put your final answer within \\boxed{{}}."


def make_records(
    split: str, size: int, *, style: str, seed: int, val_size: int, params: ArithmeticParams
) -> list[PromptRecord]:
    """``size`` records of ``split`` ("train" or "val"); train never contains a val expression."""
    if style == "plain" and params.answer_format != "boxed":
        raise ValueError(
            f"data.task_kwargs.answer_format={params.answer_format!r} applies to data.prompt_style=instruct only "
            "(a plain prompt's response is the bare value)"
        )
    expressions = _SPLITS.draw(split, size, seed=seed, val_size=val_size, draw=lambda rng: _draw(rng, params))
    label = "val" if split == "val" else "train"
    return [_record(label, i, expression, style, params) for i, expression in enumerate(expressions)]


def _record(split: str, index: int, expression: str, style: str, params: ArithmeticParams) -> PromptRecord:
    value = safe_eval(expression, "+-*")
    answer = str(value.numerator)
    metadata = {"task": "arithmetic", "style": style, "expression": expression, "solution": answer}
    rid = f"arithmetic-{split}-{index}"
    if style == "plain":
        return PromptRecord(rid, plain_prompt(expression), None, answer, "numeric", metadata)
    messages = [{"role": "user", "content": instruct_message(expression, params.answer_format)}]
    return PromptRecord(rid, None, messages, answer, VERIFIERS[params.answer_format], metadata)
