"""Telemetry of tool-using episodes: how often the policy calls the tool, how calls go, how episodes end,
and which policy tokens come right after a tool's reply (their entropy is logged apart).

Not from the paper, which shows entropy curves of its tool-use runs without splitting them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from stare_lightning.metrics.base import TelemetryMetric

# The policy tokens counted as "right after a tool output": this many, from the first one after each reply.
AFTER_TOOL_WINDOW = 8
_COUNTS = ("episodes", "used_tool", "calls", "errors", "timeouts", "malformed", "turns", "by_turns", "by_tokens")


def after_tool_mask(response_mask: Tensor, window: int = AFTER_TOOL_WINDOW) -> Tensor:
    """bool ``[rows, width]``: the first ``window`` policy tokens of every run of policy tokens that follows a
    tool reply (tokens inside the response but outside ``response_mask``, i.e. not trailing padding)."""
    mask = response_mask.bool()
    starts = torch.zeros_like(mask)
    starts[:, 1:] = mask[:, 1:] & ~mask[:, :-1]  # a policy token after a non-policy one inside the response
    near, run = starts.clone(), starts.clone()
    for _ in range(window - 1):
        run = torch.cat([torch.zeros_like(run[:, :1]), run[:, :-1]], dim=1) & mask
        near |= run
    return near


class ToolUse(TelemetryMetric):
    """Per-episode tool counters, summed over ranks. ``update(episodes)`` takes ``EpisodeStats``.

    Keys: ``tool/calls_per_episode``, ``tool/used_frac`` (episodes with at least one call), ``tool/error_rate``,
    ``tool/timeout_rate`` and ``tool/malformed_rate`` (per call), ``tool/seconds`` (mean wall time of a call),
    ``episode/turns`` (mean generation turns), ``episode/ended_by_turns`` and ``episode/ended_by_tokens``
    (share of episodes that the tool-call or the token budget ended).
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        for name in _COUNTS:
            self._sum_state(name, dtype=torch.int64)
        self._sum_state("seconds")

    def update(self, episodes: Sequence) -> None:
        counts = {
            "episodes": len(episodes),
            "used_tool": sum(e.tool_calls > 0 for e in episodes),
            "calls": sum(e.tool_calls for e in episodes),
            "errors": sum(e.tool_errors for e in episodes),
            "timeouts": sum(e.tool_timeouts for e in episodes),
            "malformed": sum(e.malformed_calls for e in episodes),
            "turns": sum(e.turns for e in episodes),
            "by_turns": sum(e.ended_by == "turns" for e in episodes),
            "by_tokens": sum(e.ended_by == "tokens" for e in episodes),
        }
        self._accumulate(
            **{name: torch.tensor(value, dtype=torch.int64) for name, value in counts.items()},
            seconds=torch.tensor(sum(e.tool_seconds for e in episodes), dtype=torch.float64),
        )

    def compute(self) -> dict[str, Tensor]:
        episodes, calls = self.episodes.clamp(min=1).double(), self.calls.clamp(min=1).double()
        return {
            "tool/calls_per_episode": self.calls / episodes,
            "tool/used_frac": self.used_tool / episodes,
            "tool/error_rate": self.errors / calls,
            "tool/timeout_rate": self.timeouts / calls,
            "tool/malformed_rate": self.malformed / calls,
            "tool/seconds": self.seconds / calls,
            "episode/turns": self.turns / episodes,
            "episode/ended_by_turns": self.by_turns / episodes,
            "episode/ended_by_tokens": self.by_tokens / episodes,
        }
