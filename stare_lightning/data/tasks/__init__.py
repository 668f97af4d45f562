"""Built-in offline tasks (countdown, arithmetic), reasoning-gym generators, and the supervised cold-start pairs.

``build_records(task, split, size, style=..., seed=..., val_size=..., source=..., **task_kwargs)`` returns
deterministic :class:`PromptRecord` lists (``source="reasoning_gym"``: ``task`` names a reasoning-gym
generator or ``mixture``, see :mod:`.reasoning_gym`); ``sft_examples(records)`` turns plain-style records into
``(prompt_text, completion_text)`` pairs, where the completion is the record's ``metadata["solution"]``
(countdown: one correct expression; arithmetic: the value) and the caller appends the EOS token.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import fields
from typing import Any

from ..records import PromptRecord
from . import arithmetic, countdown, reasoning_gym

STYLES = ("plain", "instruct")
SOURCES = ("builtin", "reasoning_gym")  # what data.task names
_TASKS = {
    "countdown": (countdown.CountdownParams, countdown.make_records),
    "arithmetic": (arithmetic.ArithmeticParams, arithmetic.make_records),
}


def task_names() -> list[str]:
    """Names of the built-in tasks."""
    return sorted(_TASKS)


def task_params(task: str, task_kwargs: Mapping[str, Any] | None = None):
    """The validated parameter object of ``task``; ValueError naming any unknown or bad key."""
    if task not in _TASKS:
        raise ValueError(f"data.task: unknown task {task!r}; built-in tasks: {', '.join(task_names())}")
    params_cls = _TASKS[task][0]
    kwargs = dict(task_kwargs or {})
    allowed = [f.name for f in fields(params_cls)]
    unknown = sorted(set(kwargs) - set(allowed))
    if unknown:
        raise ValueError(f"data.task_kwargs: unknown keys {unknown} for task {task!r}; allowed: {allowed}")
    return params_cls(**kwargs)


def build_records(
    task: str,
    split: str,
    size: int,
    *,
    style: str = "plain",
    seed: int = 1234,
    val_size: int = 64,
    source: str = "builtin",
    **task_kwargs: Any,
) -> list[PromptRecord]:
    """Records of a task of ``source``. ``split`` is "train" (``size`` records) or "val" (``val_size`` records).

    The validation split depends only on (task, settings, seed, val_size); the training split never
    contains a validation problem.
    """
    if source not in SOURCES:
        raise ValueError(f"data.source must be one of {list(SOURCES)}, got {source!r}")
    params = task_params(task, task_kwargs) if source == "builtin" else reasoning_gym.parse_source(task, task_kwargs)
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    if style not in STYLES:
        raise ValueError(f"data.prompt_style must be one of {list(STYLES)}, got {style!r}")
    if type(size) is not int or size < 0 or type(val_size) is not int or val_size < 0:
        raise ValueError(f"size and val_size must be non-negative ints, got {size!r}, {val_size!r}")
    if source == "reasoning_gym":
        return reasoning_gym.make_records(params, split, size, style=style, seed=seed, val_size=val_size)
    return _TASKS[task][1](split, size, style=style, seed=seed, val_size=val_size, params=params)


def sft_examples(records: Iterable[PromptRecord]) -> list[tuple[str, str]]:
    """``(prompt_text, completion_text)`` pairs for plain-style supervised cold start (EOS not included)."""
    pairs = []
    for record in records:
        if record.prompt is None or record.metadata.get("style", "plain") != "plain":
            raise ValueError(
                f"sft_examples needs plain-style records (a 'prompt' string); record {record.id!r} is "
                f"{'a chat' if record.prompt is None else 'instruct-style'}: build the task with prompt_style='plain'"
            )
        completion = record.metadata.get("solution", record.answer)
        if not isinstance(completion, str) or not completion:
            raise ValueError(f"record {record.id!r}: metadata 'solution' must be a non-empty string")
        pairs.append((record.prompt, completion))
    return pairs


__all__ = ["SOURCES", "STYLES", "build_records", "sft_examples", "task_names", "task_params"]
