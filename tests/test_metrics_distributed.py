"""Two CPU processes (gloo): every metric fed a split of the data on each rank gives, after its synced
compute, the single-process result on the union (within 1e-6). Splits are uneven and one rank gets
empty batches for some metrics. The entropy forecast is fed globally reduced values, as in training,
and warns when ranks feed different values."""

from __future__ import annotations

import math
import random
import warnings

import pytest
import torch

from stare_lightning.algorithms import clipped_surrogate, zero_variance_groups
from stare_lightning.metrics import (
    AvgAtN,
    ClipFraction,
    DistinctCorrect,
    EntropyForecast,
    FracZeroStdGroups,
    GateRate,
    GradNorm,
    PassAtK,
    QuadrantMass,
    ReflectionWords,
    ResponseLength,
    RewardStats,
    RolloutCounters,
    SelectedFraction,
    TokenEntropy,
    TruncatedFraction,
    UpdateLoss,
)
from tests.distributed import run_on_ranks

WORLD = 2
TOL = 1e-6


def _check(name: str, got: dict, want: dict) -> None:
    assert set(got) == set(want), (name, set(got) ^ set(want))
    for key in want:
        g, w = float(got[key]), float(want[key])
        if math.isnan(w):
            assert math.isnan(g), (name, key, g, w)
        else:
            assert abs(g - w) <= TOL, (name, key, g, w)


def _make_data(seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    b, t = 11, 8
    mask = torch.rand(b, t, generator=gen) > 0.25
    mask[3] = False
    adv = torch.randn(b, generator=gen)
    adv[::4] = 0.0
    words = ["Wait, let me verify.", "hmm re-check", "however, actually a mistake", "", "recheck? prechecked"]
    return {
        "mask": mask,
        "entropy": torch.rand(b, t, generator=gen) * 2,
        "adv": adv,
        "adv_tok": torch.randn(b, t, generator=gen),
        "phi": torch.randn(b, t, generator=gen),
        "omega": torch.rand(b, t, generator=gen) + 0.5,
        "selected": torch.rand(b, t, generator=gen) > 0.6,
        "ratio": torch.rand(b, t, generator=gen) + 0.5,
        "texts": [" ".join(rng.choice(words) for _ in range(rng.randint(0, 4))) for _ in range(b)],
        "n": torch.randint(8, 17, (b,), generator=gen),
        "c_frac": torch.rand(b, generator=gen),
        "groups": [[rng.choice(["1", " 1", "2", "x"]) for _ in range(rng.randint(1, 4))] for _ in range(b)],
        "rewards": torch.randint(0, 2, (b, 4), generator=gen).float(),
        "gate": [True, False, True, True, False],
        "truncated": torch.rand(b, generator=gen) > 0.7,
        "loss": torch.randn(b, generator=gen),
        "pg_loss": torch.randn(b, generator=gen),
        "kl": torch.rand(b, generator=gen),
        "tokens": torch.randint(1, 9, (b,), generator=gen).float(),
        "gen_tokens": torch.randint(10, 90, (b,), generator=gen).tolist(),
    }


def _feed(metrics: dict, d: dict, lo: int, hi: int) -> None:
    s = slice(lo, hi)
    n = d["n"][s]
    c = (d["c_frac"][s] * n).floor().long()
    metrics["entropy"].update(d["entropy"][s], d["mask"][s])
    metrics["quadrant_seq"].update(d["adv"][s], d["mask"][s], d["phi"][s], d["omega"][s], d["selected"][s])
    metrics["quadrant_tok"].update(d["adv_tok"][s], d["mask"][s], d["phi"][s])
    metrics["reflection"].update(d["texts"][s])
    metrics["pass"].update(c, n)
    metrics["avg"].update(c, n)
    flags = [[i % 2 == 0 for i in range(len(g))] for g in d["groups"][s]]
    metrics["distinct"].update(d["groups"][s], flags)
    metrics["length"].update(d["mask"][s])
    _, clip = clipped_surrogate(
        d["ratio"][s].log(), torch.zeros_like(d["ratio"][s]), d["adv"][s], d["mask"][s], eps_low=0.2, eps_high=0.28
    )
    metrics["clip"].update(clip.clip_low, clip.clip_high, clip.tokens)
    metrics["zero_std"].update(zero_variance_groups(d["rewards"][s]))
    metrics["reward"].update(d["rewards"][s])
    metrics["selection"].update(d["selected"][s], d["adv"][s], d["mask"][s])
    metrics["truncated"].update(d["truncated"][s])
    for i in range(lo, hi):  # one micro-batch per row: each rank adds its share of the step's loss
        metrics["loss"].update(d["loss"][i], d["pg_loss"][i], d["kl"][i], d["tokens"][i])
        metrics["rollout"].update(tokens=d["gen_tokens"][i], seconds=0.5, timeouts=i % 2, errors=1, batches=0)


def _make_metrics(**kwargs) -> dict:
    return {
        "entropy": TokenEntropy(**kwargs),
        "quadrant_seq": QuadrantMass(**kwargs),
        "quadrant_tok": QuadrantMass(**kwargs),
        "reflection": ReflectionWords(**kwargs),
        "pass": PassAtK(k=(1, 4, 8), **kwargs),
        "avg": AvgAtN(**kwargs),
        "distinct": DistinctCorrect(**kwargs),
        "length": ResponseLength(**kwargs),
        "clip": ClipFraction(**kwargs),
        "zero_std": FracZeroStdGroups(**kwargs),
        "gate": GateRate(**kwargs),
        "reward": RewardStats(**kwargs),
        "selection": SelectedFraction(**kwargs),
        "truncated": TruncatedFraction(**kwargs),
        "loss": UpdateLoss(**kwargs),
        "grad_norm": GradNorm(**kwargs),
        "rollout": RolloutCounters(**kwargs),
    }


def _worker(rank: int, world: int) -> None:
    data = _make_data(seed=5)
    b = data["mask"].shape[0]

    # Split metrics: rank 0 gets rows [0, 3) in two updates (one empty), rank 1 gets [3, b).
    shared = _make_metrics()
    local = _make_metrics(sync_on_compute=False)
    _feed(local, data, 0, b)
    if rank == 0:
        _feed(shared, data, 0, 3)
        _feed(shared, data, 3, 3)
    else:
        _feed(shared, data, 3, b)
    for metrics in (shared, local):  # global quantities: every rank records the same values
        for flag in data["gate"]:
            metrics["gate"].update(flag)
        for norm in (0.5, 2.0, 1.25):  # three optimizer steps of the step's update
            metrics["grad_norm"].update(norm)
            metrics["loss"].update(steps=1)
        metrics["rollout"].update(tokens=0, seconds=0.0, timeouts=0, errors=0, batches=2)
    for name in local:
        _check(name, shared[name].compute(), local[name].compute())

    # A rank with no data at all: its states are the defaults and must not disturb the result.
    empty_ok = ResponseLength()
    if rank == 0:
        empty_ok.update(torch.tensor([4, 9, 2]))
    else:
        empty_ok.update(torch.tensor([], dtype=torch.long))
    _check("length_empty_rank", empty_ok.compute(), {"response_length/mean": 5.0, "response_length/max": 9.0})

    # Forecast over steps: each step's entropy and predicted change come from synced metrics.
    forecast = EntropyForecast(window=4)
    forecast_ref = EntropyForecast(window=4, sync_on_compute=False)
    for step in range(6):
        d = _make_data(seed=100 + step)
        ent, quad = TokenEntropy(), QuadrantMass()
        ent_ref, quad_ref = TokenEntropy(sync_on_compute=False), QuadrantMass(sync_on_compute=False)
        lo, hi = (0, 6) if rank == 0 else (6, b)
        ent.update(d["entropy"][lo:hi], d["mask"][lo:hi])
        quad.update(d["adv"][lo:hi], d["mask"][lo:hi], d["phi"][lo:hi], d["omega"][lo:hi], d["selected"][lo:hi])
        ent_ref.update(d["entropy"], d["mask"])
        quad_ref.update(d["adv"], d["mask"], d["phi"], d["omega"], d["selected"])

        def predicted(q: dict) -> torch.Tensor:
            return 0.5 * sum(q[f"quadrant/exact/{name}/dH"] for name in ("pos_high", "pos_low", "neg_high", "neg_low"))

        forecast.update(ent.compute()["entropy"], predicted(quad.compute()))
        forecast_ref.update(ent_ref.compute()["entropy"], predicted(quad_ref.compute()))
        _check(f"forecast_step{step}", forecast.compute(), forecast_ref.compute())

    # Rank-local inputs where global ones belong: warned about, rank 0's view kept.
    wrong = EntropyForecast(window=3)
    for step in range(3):
        wrong.update(0.1 * step + rank, 0.01)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = wrong.compute()
    assert any("differs across ranks" in str(w.message) for w in caught)
    assert abs(float(out["entropy/realized_delta"]) - 0.1) < TOL


@pytest.mark.slow
def test_metrics_on_two_gloo_ranks_equal_single_process_on_the_union(tmp_path):
    run_on_ranks(_worker, tmp_path, world=WORLD)
