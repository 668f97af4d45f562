"""The step timer's accounting: laps charge their phase, collection's generation and verification move out of it."""

from __future__ import annotations

import time

import pytest
import torch

from stare_lightning.metrics.step_timer import PHASES, StepTimer


def test_phases_add_up_to_the_step_and_collection_is_split():
    timer = StepTimer(torch.device("cpu"))
    time.sleep(0.06)
    timer.lap("collect")  # 0.06 s, of which the engine reported 0.03 s generating and 0.01 s verifying
    time.sleep(0.02)
    timer.lap("update")
    time.sleep(0.01)
    timer.lap("update")  # a phase may be charged twice
    out = timer.metrics(rollout_seconds=0.03, verify_seconds=0.01, tokens=500)
    assert set(out) == {*(f"time/{p}" for p in PHASES), "time/step_s", "throughput/tokens_per_s"}
    assert sum(out[f"time/{p}"] for p in PHASES) == pytest.approx(out["time/step_s"], rel=1e-12)
    assert (out["time/rollout"], out["time/verify"]) == (0.03, 0.01)
    assert out["time/update"] >= 0.03 and out["time/score"] == 0.0
    assert 0.02 <= out["time/other"] < 0.02 + 0.03  # collection's remainder, plus the few microseconds after
    assert out["throughput/tokens_per_s"] == pytest.approx(500 / out["time/step_s"])
