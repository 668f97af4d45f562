"""A task of your own: put four numbers in increasing order. Its records, and the verifier that scores them.

Records are written to a JSONL file that ``data=files`` reads; each names the verifier ``verify_sorted`` by its
``package.module:function`` name.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

VERIFIER = "my_project.tasks:verify_sorted"


def make_records(size: int, *, seed: int = 0) -> list[dict]:
    """``size`` prompt records: ``"Sort: 42 7 19 3\\nAnswer:"``, answer ``"3 7 19 42"``."""
    rng = random.Random(seed)
    records = []
    for index in range(size):
        numbers = rng.sample(range(100), 4)
        records.append(
            {
                "id": f"sort-{seed}-{index}",
                "prompt": f"Sort: {' '.join(map(str, numbers))}\nAnswer:",
                "answer": " ".join(map(str, sorted(numbers))),
                "verifier": VERIFIER,
                "metadata": {"numbers": numbers},
            }
        )
    return records


def write_jsonl(records: list[dict], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def verify_sorted(response: str, answer: str, metadata: dict) -> float:
    """1.0 when the numbers of the response's first line are the answer's, in its order; else 0.0."""
    lines = response.strip().splitlines()
    found = re.findall(r"-?\d+", lines[0]) if lines else []
    return 1.0 if found == answer.split() else 0.0


def check_record(answer: str, metadata: dict) -> None:
    """A record this verifier could never score fails when the data are loaded, before training."""
    numbers = metadata.get("numbers")
    if not isinstance(numbers, list) or answer.split() != [str(n) for n in sorted(numbers)]:
        raise ValueError(f"answer {answer!r} is not metadata.numbers={numbers!r} in increasing order")


verify_sorted.check_record = check_record
