"""Countdown: combine the given numbers, each exactly once, with + - * and parentheses to hit the target.

Problems are small enough for the built-in 2-layer character-level model (default: 3 numbers from 1..9)
and every target can be reached in several ways. All solutions are enumerated exactly, printed with the
fewest parentheses; each record knows how many distinct solution strings it has (``num_solutions``)
and how many distinct forms (``num_forms``: solutions that stay distinct after sorting the terms of
sums and the factors of products; ``3*5+7`` and ``7+5*3`` are one form, for ``2 3 4 -> 10`` ``2*3+4``
and ``3*4-2`` are two). A target is used when it has at least ``min_solutions`` strings and
``min_forms`` forms. With the defaults (4 strings, 1 form) there are 1128 distinct problems, 5.25
solution strings each on average; ``min_forms=2`` leaves only 187 (7.1 strings each), too few to hold
out a validation split and still train on many problems, hence not the default. Each record carries
one solution, drawn at random with a fixed seed, as ``solution`` for supervised cold-start data.

Splits are deterministic and disjoint: the validation problems are drawn first from their own seeded
stream and the training stream skips them, where a problem is the multiset of numbers plus the target
(the order the numbers are shown in does not make a new problem). The training split is a stream of
draws, so with a small problem space it repeats problems (in fresh number orders).

Prompt styles: plain ``"3 5 7 -> 22:"`` with the response ``"3*5+7"`` then EOS; instruct, one user
message asking for the expression within ``\\boxed{}``.
"""

from __future__ import annotations

import ast
import random
from dataclasses import dataclass, fields
from fractions import Fraction
from functools import lru_cache

from ...rewards.expr import parse_expression
from ..records import PromptRecord
from .splits import DisjointSplits

VERIFIER = "countdown"
_SPLITS = DisjointSplits("countdown", "problem", "widen the number range or lower data.val_size")
_PREC = {"+": 1, "-": 1, "*": 2, "/": 2}


@dataclass(frozen=True)
class CountdownParams:
    """Settings of the countdown generator (``data.task_kwargs``)."""

    num_numbers: int = 3
    min_number: int = 1
    max_number: int = 9
    min_target: int = 1
    max_target: int | None = None
    min_solutions: int = 4
    min_forms: int = 1
    ops: str = "+-*"

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "ops":
                if not isinstance(value, str) or not value or set(value) - set("+-*/") or len(set(value)) != len(value):
                    raise ValueError(
                        f"data.task_kwargs.ops must be a string of distinct characters from '+-*/', got {value!r}"
                    )
            elif f.name == "max_target" and value is None:
                continue
            elif type(value) is not int:
                raise ValueError(f"data.task_kwargs.{f.name} must be an int, got {value!r}")
        if not 2 <= self.num_numbers <= 5:
            raise ValueError(
                f"data.task_kwargs.num_numbers must be in 2..5 (solutions are enumerated), got {self.num_numbers}"
            )
        if not 0 <= self.min_number <= self.max_number:
            raise ValueError(
                f"data.task_kwargs needs 0 <= min_number <= max_number, got {self.min_number}..{self.max_number}"
            )
        if self.max_target is not None and self.max_target < self.min_target:
            raise ValueError(f"data.task_kwargs.max_target ({self.max_target}) is below min_target ({self.min_target})")
        if self.min_forms < 1 or self.min_solutions < 1:
            raise ValueError(
                f"data.task_kwargs.min_forms and min_solutions must be >= 1, got {self.min_forms}, {self.min_solutions}"
            )


def _combine(op: str, a: tuple, b: tuple) -> tuple | None:
    """Combine two (value, text, precedence) triples; precedence 1: + -, 2: * /, 3: a literal."""
    if op == "+":
        value = a[0] + b[0]
    elif op == "-":
        value = a[0] - b[0]
    elif op == "*":
        value = a[0] * b[0]
    else:
        if b[0] == 0:
            return None
        value = a[0] / b[0]
    p = _PREC[op]
    left = f"({a[1]})" if a[2] < p else a[1]
    right = f"({b[1]})" if b[2] < p or (b[2] == p and op in "-/") else b[1]
    return value, left + op + right, p


def canonical_form(text: str) -> str:
    """A string that two expressions share when they differ only by the order of terms / factors."""

    def walk(node) -> tuple[str, str]:  # (kind, canon); kind "S" sum, "P" product, "N" literal
        if isinstance(node, ast.Constant):
            return "N", str(node.value)
        kind = "S" if isinstance(node.op, (ast.Add, ast.Sub)) else "P"
        plus, minus = ("+", "-") if kind == "S" else ("*", "/")
        parts = []
        for child, negate in ((node.left, False), (node.right, isinstance(node.op, (ast.Sub, ast.Div)))):
            ckind, ccanon = walk(child)
            if ckind == kind:
                inner = _parts[ccanon]
            else:
                inner = ((plus, ccanon),)
            if negate:
                inner = tuple((minus if s == plus else plus, c) for s, c in inner)
            parts.extend(inner)
        parts.sort()
        canon = kind + "(" + ",".join(s + c for s, c in parts) + ")"
        _parts[canon] = tuple(parts)
        return kind, canon

    _parts: dict[str, tuple] = {}
    return walk(parse_expression(text))[1]


@lru_cache(maxsize=4096)
def solutions(numbers: tuple, ops: str) -> dict:
    """Every integer reachable from ``numbers`` (each used once) -> sorted tuple of its solution strings."""
    exact = "/" in ops
    n = len(numbers)
    table: dict[int, dict[str, tuple]] = {
        1 << i: {str(v): (Fraction(v) if exact else v, str(v), 3)} for i, v in enumerate(numbers)
    }
    for mask in sorted(range(1, 1 << n), key=lambda m: bin(m).count("1")):
        if mask in table:
            continue
        found: dict[str, tuple] = {}
        sub = (mask - 1) & mask
        while sub:
            lefts, rights = table[sub].values(), table[mask ^ sub].values()
            for a in lefts:
                for b in rights:
                    for op in ops:
                        e = _combine(op, a, b)
                        if e is not None and e[1] not in found:
                            found[e[1]] = e
            sub = (sub - 1) & mask
        table[mask] = found
    by_value: dict[int, list] = {}
    for value, text, _ in table[(1 << n) - 1].values():
        if exact:
            if value.denominator != 1:
                continue
            value = value.numerator
        by_value.setdefault(int(value), []).append(text)
    return {v: tuple(sorted(texts)) for v, texts in by_value.items()}


@lru_cache(maxsize=65536)
def num_forms(numbers: tuple, ops: str, target: int) -> int:
    """How many distinct canonical forms the solutions of ``target`` have."""
    return len({canonical_form(t) for t in solutions(numbers, ops)[target]})


@lru_cache(maxsize=4096)
def _valid_targets(numbers: tuple, params: CountdownParams) -> tuple:
    hi = params.max_target
    return tuple(
        sorted(
            t
            for t, texts in solutions(numbers, params.ops).items()
            if t >= params.min_target
            and (hi is None or t <= hi)
            and len(texts) >= params.min_solutions
            and (params.min_forms <= 1 or num_forms(numbers, params.ops, t) >= params.min_forms)
        )
    )


def _draw(rng: random.Random, params: CountdownParams) -> tuple:
    """One problem: (numbers in shown order, target, chosen solution, num_solutions, num_forms)."""
    for _ in range(1000):
        multiset = tuple(sorted(rng.randint(params.min_number, params.max_number) for _ in range(params.num_numbers)))
        targets = _valid_targets(multiset, params)
        if targets:
            break
    else:
        raise ValueError(
            f"countdown: no target with {params.min_solutions}+ solutions and {params.min_forms}+ forms for {params}; "
            "widen the number or target range or lower min_solutions / min_forms"
        )
    target = rng.choice(targets)
    texts = solutions(multiset, params.ops)[target]
    solution = rng.choice(texts)
    shown = list(multiset)
    rng.shuffle(shown)
    return shown, target, solution, len(texts), num_forms(multiset, params.ops, target)


def _ops_words(ops: str) -> str:
    names = [c for c in "+-*/" if c in ops]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def plain_prompt(numbers: list, target: int) -> str:
    """``"3 5 7 -> 22:"``"""
    return " ".join(str(n) for n in numbers) + f" -> {target}:"


def instruct_message(numbers: list, target: int, ops: str) -> str:
    """The user message of the instruct style."""
    shown = ", ".join(str(n) for n in numbers[:-1]) + f" and {numbers[-1]}"
    return (
        f"Using the numbers {shown}, write an arithmetic expression that equals {target}. "
        f"Use each number exactly once and only the operations {_ops_words(ops)} (parentheses are allowed). "
        "Put your final expression within \\boxed{}."
    )


def make_records(
    split: str, size: int, *, style: str, seed: int, val_size: int, params: CountdownParams
) -> list[PromptRecord]:
    """``size`` records of ``split`` ("train" or "val"); train never contains a val problem."""
    problems = _SPLITS.draw(
        split, size, seed=seed, val_size=val_size, draw=lambda rng: _draw(rng, params), key=_problem_key
    )
    label = "val" if split == "val" else "train"
    return [_record(label, i, *problem, style, params) for i, problem in enumerate(problems)]


def _problem_key(problem: tuple) -> tuple:
    """Two draws are the same problem when they show the same numbers (in any order) for the same target."""
    shown, target = problem[:2]
    return tuple(sorted(shown)), target


def _record(split, index, shown, target, solution, n_sol, n_forms, style, params) -> PromptRecord:
    metadata = {
        "task": "countdown",
        "style": style,
        "numbers": list(shown),
        "target": target,
        "ops": params.ops,
        "solution": solution,
        "num_solutions": n_sol,
        "num_forms": n_forms,
    }
    rid = f"countdown-{split}-{index}"
    if style == "plain":
        return PromptRecord(rid, plain_prompt(shown, target), None, str(target), VERIFIER, metadata)
    messages = [{"role": "user", "content": instruct_message(shown, target, params.ops)}]
    return PromptRecord(rid, None, messages, str(target), VERIFIER, metadata)
