"""What every tool is: ``ToolResult``, the ``Tool`` protocol, its function schema, and ``run_calls`` (calls at once).

A tool never raises into the rollout loop: ``run_calls`` turns anything a tool raises into a failed result, so a
bad call costs the episode one error message and never crashes a rank.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

__all__ = ["TRUNCATION_MARKER", "Tool", "ToolResult", "clip_text", "compose_text", "function_schema", "run_calls"]

TRUNCATION_MARKER = "\n... [output truncated]"


@dataclass(frozen=True)
class ToolResult:
    text: str  # what the model sees: output, or an error message; already truncated to the tool's limit
    ok: bool  # False: an error, a time-out, a refused call
    seconds: float  # wall time of the call
    timed_out: bool = False


@runtime_checkable
class Tool(Protocol):
    name: str  # "python", "calculator"
    argument: str  # the argument's name in JSON tool calls: "code" for python, "expression" for calculator
    description: str  # one line, for the function schema

    def run(self, call: str, *, history: Sequence[str] = ()) -> ToolResult:
        """Run one call. ``history``: the earlier calls of the same episode, oldest first (a stateful tool
        replays them; others ignore it)."""
        ...

    def close(self) -> None: ...


def clip_text(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters, with ``TRUNCATION_MARKER`` appended when anything was cut."""
    return text if len(text) <= limit else text[:limit] + TRUNCATION_MARKER


def compose_text(output: str, note: str | None, limit: int, truncated: bool = False) -> str:
    """``output`` (cut, with the marker, when ``truncated`` or too long), then ``note`` (an error line) on a line of
    its own; at most ``limit`` characters plus the marker."""
    room = limit - (len(note) + 1 if note else 0)
    if room <= 0:
        return (note or "")[:limit]
    body = output[:room] + TRUNCATION_MARKER if truncated or len(output) > room else output
    return f"{body}\n{note}" if note and body else (note or body)


def function_schema(tool: Tool) -> dict[str, Any]:
    """The OpenAI / Hugging Face function schema of ``tool``, for a chat template's ``tools=``."""
    argument_help = getattr(tool, "argument_description", f"The {tool.argument} to run.")
    return {
        "type": "function",
        "function": {
            "name": tool.name,
            "description": tool.description,
            "parameters": {
                "type": "object",
                "properties": {tool.argument: {"type": "string", "description": argument_help}},
                "required": [tool.argument],
            },
        },
    }


def _run_one(tool: Tool, call: str, history: Sequence[str]) -> ToolResult:
    """``tool.run``, with anything it raises turned into a failed result naming the exception."""
    started = time.perf_counter()
    try:
        return tool.run(call, history=history)
    except Exception as err:  # a tool's bug must not take the rank down: the model sees the error instead
        return ToolResult(text=f"{type(err).__name__}: {err}", ok=False, seconds=time.perf_counter() - started)


def run_calls(tool: Tool, calls: Sequence[tuple[str, Sequence[str]]], max_workers: int) -> list[ToolResult]:
    """Run every ``(call, history)`` with at most ``max_workers`` at once; the results in input order.

    Threads suffice: the expensive tools wait on a subprocess or a socket, and the calculator is bounded.
    """
    if max_workers < 1:
        raise ValueError(f"max_workers={max_workers} is out of range: must be an integer >= 1")
    if len(calls) <= 1 or max_workers == 1:
        return [_run_one(tool, call, history) for call, history in calls]
    with ThreadPoolExecutor(max_workers=min(max_workers, len(calls)), thread_name_prefix=f"tool-{tool.name}") as pool:
        futures = [pool.submit(_run_one, tool, call, history) for call, history in calls]
        return [f.result() for f in futures]
