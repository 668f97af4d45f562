"""Majority vote over a prompt's samples (maj@n), with answers compared the way the verifier compares them.

Each response's final answer is read as the verifiers read it (the last ``\\boxed{}`` or an ``Answer:``
line, else the whole response), then normalised (math delimiters, ``\\text{}``, case and spacing). Two
answers are one vote when their normalised text matches or, for the ``math`` verifier, when math-verify
finds them equivalent (checked in the verifier pool, under its time-out). The vote with most members wins;
a tie goes to the vote whose first member came first. maj@n is the correctness of the winning vote (the
score of its first member). Responses without an answer do not vote; a prompt with no votes scores 0.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import combinations

from .basic import normalize_text
from .extract import final_answer
from .pool import VerifierPool

# Verifiers whose answers are compared by equivalence (through the pool) rather than by normalised text.
_EQUIVALENCE_VERIFIERS = ("math",)


def answer_key(response: str) -> str | None:
    """The normalised final answer of ``response``; None when it has none."""
    answer = final_answer(response)
    text = normalize_text(response if answer is None else answer)
    return text or None


def winning_vote(keys: Sequence[str | None], same: Callable[[str, str], bool]) -> int | None:
    """Index of the first member of the largest vote among ``keys`` (None entries do not vote)."""
    representatives: list[str] = []
    first: list[int] = []
    size: list[int] = []
    for index, key in enumerate(keys):
        if key is None:
            continue
        for vote, rep in enumerate(representatives):
            if key == rep or same(key, rep):
                size[vote] += 1
                break
        else:
            representatives.append(key)
            first.append(index)
            size.append(1)
    if not size:
        return None
    best = max(range(len(size)), key=lambda v: (size[v], -first[v]))
    return first[best]


def majority_correct(
    items: Sequence[dict], texts: Sequence[str], scores: Sequence[float], n: int, pool: VerifierPool
) -> list[bool]:
    """maj@n of each prompt: ``texts`` and ``scores`` hold ``n`` samples per item, grouped by item."""
    keys = [answer_key(text) for text in texts]
    equivalent = _equivalent_pairs(items, keys, n, pool)
    out = []
    for p in range(len(items)):
        group = keys[p * n : (p + 1) * n]
        pairs = equivalent.get(p, set())
        winner = winning_vote(group, lambda a, b, pairs=pairs: (a, b) in pairs or (b, a) in pairs)
        out.append(winner is not None and scores[p * n + winner] > 0.5)
    return out


def _equivalent_pairs(items: Sequence[dict], keys: Sequence[str | None], n: int, pool: VerifierPool) -> dict:
    """For prompts scored by an equivalence verifier: {prompt: {(a, b) judged equivalent}} over distinct keys."""
    calls, owners = [], []
    for p, item in enumerate(items):
        if item["verifier"] not in _EQUIVALENCE_VERIFIERS:
            continue
        distinct = sorted({k for k in keys[p * n : (p + 1) * n] if k is not None})
        for a, b in combinations(distinct, 2):
            calls.append((item["verifier"], f"\\boxed{{{a}}}", b, item.get("metadata", {})))
            owners.append((p, a, b))
    found: dict[int, set] = {}
    if calls:
        for (p, a, b), score in zip(owners, pool.score(calls).scores):
            if score > 0.5:
                found.setdefault(p, set()).add((a, b))
    return found
