"""LogprobCanary: metrics, patience, reset on recovery, masking, and agreement across ranks."""

from __future__ import annotations

import math

import pytest
import torch

from stare_lightning.rollout.canary import MAX_KEY, MEAN_KEY, LogprobCanary, NonFiniteLogprobs
from tests.distributed import run_on_ranks


def _pair(diff: float, shape=(2, 5)):
    trainer = -torch.rand(shape) - 0.1
    return trainer + diff, trainer


def test_metrics_are_token_means_over_the_mask():
    engine = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, 0.0, 0.0]])
    trainer = torch.tensor([[-1.5, -2.0, -2.0], [-1.25, -9.0, -9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    metrics = LogprobCanary(threshold=10).update(engine, trainer, mask)
    assert metrics[MEAN_KEY] == pytest.approx((0.5 + 0 + 1 + 0.25) / 4)
    assert metrics[MAX_KEY] == pytest.approx(1.0)  # the 9.0 gaps are padding
    assert set(metrics) == {"rollout/logprob_abs_diff/mean", "rollout/logprob_abs_diff/max"}


def test_raises_after_patience_consecutive_steps():
    canary = LogprobCanary(threshold=0.05, patience=3)
    canary.update(*_pair(0.2))
    canary.update(*_pair(0.2))
    with pytest.raises(RuntimeError, match="stale weights.*sync_weights"):
        canary.update(*_pair(0.2))


def test_a_good_step_resets_the_count():
    canary = LogprobCanary(threshold=0.05, patience=2)
    for _ in range(5):
        canary.update(*_pair(0.2))
        canary.update(*_pair(1e-6))
    assert canary.strikes == 0


def test_a_stale_batch_is_measured_but_neither_strikes_nor_clears():
    """``rollout.max_staleness``: a batch from an older policy reports its gap; the strikes of fresh ones stand."""
    canary = LogprobCanary(threshold=0.05, patience=2)
    canary.update(*_pair(0.2))
    assert canary.update(*_pair(1.5), judge=False)[MEAN_KEY] == pytest.approx(1.5)
    assert canary.update(*_pair(1e-6), judge=False)[MEAN_KEY] == pytest.approx(1e-6, abs=1e-6)
    assert canary.strikes == 1  # a fresh step's strike survives stale steps, good or bad
    with pytest.raises(RuntimeError, match="stale weights"):
        canary.update(*_pair(0.2))


@pytest.mark.parametrize("poison", [float("nan"), float("inf"), -float("inf")])
def test_a_non_finite_gap_stops_at_the_first_step_and_says_which_side(poison):
    """``mean > threshold`` is False for NaN: a NaN gap used to count as no strike at all, on every step."""
    engine, trainer = _pair(1e-6)
    engine[0, 1] = poison
    mean = LogprobCanary(patience=0).update(engine, trainer)[MEAN_KEY]
    # The precondition: the strike test alone never fires on a NaN gap, and needs `patience` steps for an inf one.
    assert math.isinf(poison) or not mean > 0.05
    with pytest.raises(
        NonFiniteLogprobs, match=r"not finite: 1 of the engine's and 0 of the trainer's 10 .*non-finite weights"
    ):
        LogprobCanary(threshold=0.05, patience=3).update(engine, trainer)
    # On the trainer's side, and on a stale batch too: a non-finite log-prob is never an off-policy gap.
    with pytest.raises(NonFiniteLogprobs, match=r"0 of the engine's and 1 of the trainer's .*trainer's weights"):
        LogprobCanary(patience=3).update(trainer, engine, judge=False)
    # Masked-out padding may hold anything.
    mask = torch.ones_like(engine, dtype=torch.bool)
    mask[0, 1] = False
    assert LogprobCanary(patience=3).update(engine, trainer, mask)[MEAN_KEY] < 1e-5


def test_patience_zero_only_reports_and_empty_mask_is_harmless():
    canary = LogprobCanary(threshold=0.05, patience=0)
    for _ in range(5):
        assert canary.update(*_pair(3.0))[MEAN_KEY] == pytest.approx(3.0)
    engine, trainer = _pair(3.0)
    assert LogprobCanary(patience=1).update(engine, trainer, torch.zeros_like(engine))[MEAN_KEY] == 0.0


def test_invalid_arguments():
    with pytest.raises(ValueError):
        LogprobCanary(threshold=0)
    with pytest.raises(ValueError):
        LogprobCanary(patience=-1)
    with pytest.raises(ValueError):
        LogprobCanary().update(torch.zeros(2, 3), torch.zeros(2, 4))


def _rank_worker(rank: int, world: int) -> str:
    canary = LogprobCanary(threshold=0.5, patience=1)
    # Rank 0 alone is far off (3 tokens at 1.0); rank 1 is exact on 1 token: global mean 0.75 > 0.5.
    diff, tokens = (1.0, 3) if rank == 0 else (0.0, 1)
    trainer = torch.zeros(1, tokens)
    try:
        canary.update(trainer + diff, trainer)
        return "no error"
    except RuntimeError:
        return "raised"


@pytest.mark.slow
def test_ranks_agree_and_raise_together(tmp_path):
    results = run_on_ranks(_rank_worker, tmp_path)
    assert results == {0: "raised", 1: "raised"}


def test_the_non_finite_stop_is_one_line_and_the_disagreement_stop_a_traceback(capsys):
    """A run reports a user error as one line on stderr (exit status 2); the non-finite stop is one, while a
    sustained disagreement (the control) stays a RuntimeError, a fault of the run's setup that keeps its traceback."""
    from stare_lightning.user_errors import reported

    engine, trainer = _pair(1e-6)
    engine[0, 1] = float("nan")
    with pytest.raises(SystemExit) as stop:
        reported(lambda: LogprobCanary(patience=3).update(engine, trainer))
    assert stop.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: Rollout engine and trainer log-probs are not finite")
    with pytest.raises(RuntimeError, match="disagree"):
        reported(lambda: LogprobCanary(threshold=0.05, patience=1).update(*_pair(3.0)))
