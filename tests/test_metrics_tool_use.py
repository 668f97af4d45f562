"""Tool-use telemetry against loop references: the after-tool token mask and the per-episode counters."""

from __future__ import annotations

import random

import pytest
import torch

from stare_lightning.metrics.tool_use import ToolUse, after_tool_mask
from stare_lightning.rollout.base import EpisodeStats


def _after_tool_loop(mask: list[bool], length: int, window: int) -> list[bool]:
    """Walk the response: after every tool token, the next ``window`` policy tokens of the same run count."""
    out, since_tool = [False] * len(mask), None
    for t in range(length):
        if not mask[t]:
            since_tool = 0
            continue
        if since_tool is not None and since_tool < window:
            out[t] = True
            since_tool += 1
        else:
            since_tool = None
    return out


@pytest.mark.parametrize("window", [1, 3, 8])
def test_after_tool_mask_matches_a_loop(window):
    rng = random.Random(window)
    rows, width = 64, 40
    mask = torch.zeros(rows, width, dtype=torch.bool)
    lengths = []
    for r in range(rows):
        length = rng.randint(1, width)
        lengths.append(length)
        t = 0
        while t < length:  # alternate policy and tool runs of random lengths; the first token is the policy's
            run = rng.randint(1, 6)
            mask[r, t : min(t + run, length)] = True
            t += run + rng.randint(1, 5)
    expected = torch.tensor([_after_tool_loop(mask[r].tolist(), lengths[r], window) for r in range(rows)])
    got = after_tool_mask(mask, window)
    assert torch.equal(got, expected)
    assert not (got & ~mask).any() and got.any()


def test_tool_use_counters_and_rates():
    episodes = [
        EpisodeStats(turns=3, tool_calls=2, tool_errors=1, tool_timeouts=1, tool_seconds=0.5, ended_by="answer"),
        EpisodeStats(turns=1, ended_by="tokens"),
        EpisodeStats(turns=2, tool_calls=2, tool_errors=1, malformed_calls=1, tool_seconds=0.1, ended_by="turns"),
        EpisodeStats(turns=2, tool_calls=1, tool_seconds=0.2),
    ]
    metric = ToolUse()
    metric.update(episodes[:2])
    metric.update(episodes[2:])  # two updates add up like one
    out = {k: float(v) for k, v in metric.compute().items()}
    assert out["tool/calls_per_episode"] == pytest.approx(5 / 4)
    assert out["tool/used_frac"] == pytest.approx(3 / 4)
    assert out["tool/error_rate"] == pytest.approx(2 / 5)
    assert out["tool/timeout_rate"] == pytest.approx(1 / 5)
    assert out["tool/malformed_rate"] == pytest.approx(1 / 5)
    assert out["tool/seconds"] == pytest.approx(0.8 / 5)
    assert out["episode/turns"] == pytest.approx(8 / 4)
    assert out["episode/ended_by_turns"] == pytest.approx(1 / 4)
    assert out["episode/ended_by_tokens"] == pytest.approx(1 / 4)


def test_tool_use_without_calls_reports_zero_rates_not_nan():
    metric = ToolUse()
    metric.update([EpisodeStats(), EpisodeStats()])
    out = {k: float(v) for k, v in metric.compute().items()}
    assert out["tool/calls_per_episode"] == 0.0 and out["tool/error_rate"] == 0.0
