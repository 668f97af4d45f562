"""The step timer's accounting: laps charge their phase, collection's generation and verification move out of it.

A hand-driven clock stands in for ``time.perf_counter``, so every charge is known exactly and the test does not
depend on how busy the machine is (the step's real time breakdown is measured by benchmarks/bench_step.py).
"""

from __future__ import annotations

import pytest
import torch

from stare_lightning.metrics.step_timer import PHASES, StepTimer


class HandClock:
    """Returns the readings it was given, one per call, and fails if asked for more."""

    def __init__(self, *readings: float) -> None:
        self.readings = list(readings)

    def __call__(self) -> float:
        assert self.readings, "the timer read the clock more often than the test expects"
        return self.readings.pop(0)


def test_phases_add_up_to_the_step_and_collection_is_split():
    # Readings: start, collect (0.5 s), update (0.25 s), update again (0.125 s), metrics' final lap (0.0625 s).
    clock = HandClock(100.0, 100.5, 100.75, 100.875, 100.9375)
    timer = StepTimer(torch.device("cpu"), clock=clock)
    timer.lap("collect")  # of its 0.5 s the engine reported 0.25 s generating, 0.125 s verifying, 0.0625 s in tools
    timer.lap("update")
    timer.lap("update")  # a phase may be charged twice
    out = timer.metrics(rollout_seconds=0.25, verify_seconds=0.125, tool_seconds=0.0625, tokens=500)
    assert not clock.readings
    assert set(out) == {*(f"time/{p}" for p in PHASES), "time/step_s", "throughput/tokens_per_s"}
    assert out["time/step_s"] == 0.9375
    assert (out["time/rollout"], out["time/verify"], out["time/tool"]) == (0.25, 0.125, 0.0625)
    assert out["time/update"] == 0.375 and out["time/score"] == out["time/sync"] == out["time/telemetry"] == 0.0
    # Collection's remainder (0.5 - 0.4375) plus the time after the last lap (0.0625).
    assert out["time/other"] == 0.125
    assert sum(out[f"time/{p}"] for p in PHASES) == out["time/step_s"]
    assert out["throughput/tokens_per_s"] == pytest.approx(500 / 0.9375, rel=1e-12)


def test_every_phase_is_charged_from_the_previous_lap_and_the_parts_sum_to_the_step():
    # Each lap's charge is the reading minus the previous one, whatever order the phases come in.
    readings = [3.0, 3.5, 5.0, 5.25, 7.0, 7.5, 8.0, 9.0]
    timer = StepTimer(torch.device("cpu"), clock=HandClock(*readings))
    for phase in ("collect", "telemetry", "score", "update", "sync", "telemetry"):
        timer.lap(phase)
    out = timer.metrics(rollout_seconds=0.25, verify_seconds=0.0, tokens=0)
    assert (out["time/telemetry"], out["time/score"], out["time/update"], out["time/sync"]) == (2.0, 0.25, 1.75, 0.5)
    assert out["time/rollout"] == 0.25 and out["time/other"] == 0.25 + 1.0  # collection's rest, then the tail
    assert out["time/step_s"] == 6.0 == sum(out[f"time/{p}"] for p in PHASES)
    assert out["throughput/tokens_per_s"] == 0.0


def test_a_step_of_no_measurable_time_reports_no_throughput():
    timer = StepTimer(torch.device("cpu"), clock=HandClock(1.0, 1.0))
    out = timer.metrics(rollout_seconds=0.0, verify_seconds=0.0, tokens=10)
    assert out["time/step_s"] == 0.0 and out["throughput/tokens_per_s"] == 0.0
