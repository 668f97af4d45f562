"""The sample record: one sampled response to a prompt record, scored (what ``evaluate`` writes to samples.jsonl).

A record: ``benchmark``, ``id`` (the prompt record's id), ``sample`` (its index among the problem's n),
``response``, ``answer`` (the reference), ``score``, ``majority`` (whether the problem's majority vote is
correct), ``length`` (response tokens) and ``truncated`` (the response hit the token budget). The validation
step builds them; ``evaluation.report`` computes avg@n, pass@k and maj@n from them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from stare_lightning.rollout.base import Rollouts


def sample_records(
    items: Sequence[dict], rollouts: Rollouts, scores: Sequence[float], majority: Sequence[bool], benchmark: str | None
) -> list[dict]:
    """One record per response of ``rollouts`` (``n`` per prompt record of ``items``, in their order)."""
    n = rollouts.n
    return [
        {
            "benchmark": benchmark,
            "id": items[row // n]["id"],
            "sample": row % n,
            "response": rollouts.texts[row],
            "answer": items[row // n]["answer"],
            "score": float(scores[row]),
            "majority": bool(majority[row // n]),
            "length": len(rollouts.response_ids[row]),
            "truncated": rollouts.finish_reasons[row] == "length",
        }
        for row in range(len(rollouts.texts))
    ]
