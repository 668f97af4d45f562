"""Synthetic tool-using traces of countdown problems, for the supervised cold start before RL with a tool.

The analogue of ReTool's cold start on code-interpreter traces, written by the task itself: a trace tries a
candidate expression with the tool, reads its value, and either answers with it (the value is the target) or
tries again; it ends with ``Answer: <expression>``, which the countdown verifier reads. Half of the traces
first try a wrong candidate (the numbers in a random order with random operators), so the policy sees the tool
telling a miss from a hit. Replies are rendered by the call format from the value the tool prints.
"""

from __future__ import annotations

import random
from collections.abc import Iterable

from stare_lightning.data.records import PromptRecord
from stare_lightning.rewards.expr import ExpressionError, evaluate, parse_expression
from stare_lightning.tools import CallFormat, Tool, ToolResult

WRONG_FIRST_SHARE = 0.5


def tool_payload(tool: Tool, expression: str) -> str:
    """What the policy writes in a call to compute ``expression`` with ``tool``."""
    return f"print({expression})" if tool.name == "python" else expression


def countdown_tool_examples(
    records: Iterable[PromptRecord], tool: Tool, call_format: CallFormat, *, seed: int
) -> list[tuple[str, str]]:
    """``(prompt_text, completion_text)`` per plain-style countdown record (EOS not included)."""
    examples = []
    for record in records:
        if record.metadata.get("task") != "countdown" or record.prompt is None:
            raise ValueError(
                f"tool traces are written for plain-style countdown records; record {record.id!r} is not one "
                "(data.task=countdown, data.prompt_style=plain)"
            )
        rng = random.Random(f"{seed}/{record.id}")
        target, solution = int(record.metadata["target"]), record.metadata["solution"]
        tries = [solution]
        if rng.random() < WRONG_FIRST_SHARE:
            wrong = _wrong_candidate(record.metadata["numbers"], record.metadata["ops"], target, rng)
            tries = [wrong, solution] if wrong is not None else tries
        parts = []
        for expression in tries:
            value = evaluate(parse_expression(expression, record.metadata["ops"]))
            parts.append(call_format.render_call(tool_payload(tool, expression)))
            parts.append(call_format.render_result(ToolResult(text=_printed(value), ok=True, seconds=0.0)))
        examples.append((record.prompt, "".join(parts) + f"Answer: {solution}"))
    return examples


def _printed(value) -> str:
    """The value as Python prints it (an integer without a decimal point)."""
    return str(int(value)) if float(value).is_integer() else str(float(value))


def _wrong_candidate(numbers: list[int], ops: str, target: int, rng: random.Random) -> str | None:
    """The numbers in a random order joined by random operators, with a value other than the target."""
    for _ in range(20):
        shown = list(numbers)
        rng.shuffle(shown)
        expression = str(shown[0]) + "".join(rng.choice(ops) + str(n) for n in shown[1:])
        try:
            value = evaluate(parse_expression(expression, ops))
        except (ExpressionError, ZeroDivisionError):
            continue
        if value != target:
            return expression
    return None
