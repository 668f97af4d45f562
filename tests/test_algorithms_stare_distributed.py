"""Scope "step" across 2 gloo processes equals one process on the concatenated batch."""

import pytest
import torch

from stare_lightning.algorithms import STARERule, stare_weights_for_scope
from stare_lightning.distributed import gather_variable_length
from tests.distributed import run_on_ranks
from tests.test_algorithms_stare import one_part_weights

pytestmark = pytest.mark.slow


def make_rank_data(seed, B, T, empty=False):
    g = torch.Generator().manual_seed(seed)
    lp = -torch.randint(0, 5, (B, T), generator=g).float() * 0.3  # ties across ranks too
    mask = torch.rand(B, T, generator=g) > 0.3
    if empty:
        mask[:] = False
    adv = torch.randn(B, generator=g)
    adv[0] = 0.0
    sens = torch.randn(B, T, generator=g)
    return lp, adv, mask, sens


def scenarios():
    return [
        # (rank 0 data, rank 1 data, STARE kwargs)
        (make_rank_data(0, 3, 8), make_rank_data(1, 5, 6), dict(variant="C2", top_ratio=0.2)),
        (make_rank_data(2, 4, 7), make_rank_data(3, 2, 9), dict(variant="O1", top_ratio=0.5, selector="sensitivity")),
        (make_rank_data(4, 3, 5), make_rank_data(5, 2, 4, empty=True), dict(variant="C2", top_ratio=1.0)),
    ]


def _worker(rank, world):
    results = {}
    for i, (d0, d1, kwargs) in enumerate(scenarios()):
        lp, adv, mask, sens = (d0, d1)[rank]
        if kwargs.get("selector") == "sensitivity":
            kwargs = dict(kwargs, sensitivity=sens)
        w, stats = one_part_weights(lp, adv, mask, scope="step", **kwargs)
        results[f"w{i}"] = w
        results[f"sel_pos{i}"] = stats.selected_pos
        # the same local data as two micro-batches with their own padding
        half = lp.shape[0] // 2 or 1
        parts = [slice(0, half), slice(half, lp.shape[0])]
        pk = {key: value for key, value in kwargs.items() if key != "sensitivity"}
        split_sens = [sens[s] for s in parts] if "sensitivity" in kwargs else None
        ws, _ = stare_weights_for_scope(
            [lp[s] for s in parts],
            [adv[s] for s in parts],
            [mask[s] for s in parts],
            scope="step",
            rule=STARERule.of(**pk),
            sensitivity=split_sens,
        )
        results[f"wparts{i}"] = torch.cat(ws, 0)
    for n0, n1 in ((4, 0), (0, 0), (1, 3)):
        n = (n0, n1)[rank]
        results[f"gather_{n0}_{n1}"] = gather_variable_length(torch.arange(n, dtype=torch.float32) + 10 * rank)
    return results


def pad_cat(tensors, T, value):
    return torch.cat([torch.nn.functional.pad(t, (0, T - t.shape[1]), value=value) for t in tensors], 0)


def test_step_scope_two_ranks_equals_one_process(tmp_path):
    got = run_on_ranks(_worker, tmp_path)
    for i, (d0, d1, kwargs) in enumerate(scenarios()):
        T = max(d0[0].shape[1], d1[0].shape[1])
        lp = pad_cat([d0[0], d1[0]], T, 0.0)
        mask = pad_cat([d0[2], d1[2]], T, False)
        sens = pad_cat([d0[3], d1[3]], T, 0.0)
        adv = torch.cat([d0[1], d1[1]])
        if kwargs.get("selector") == "sensitivity":
            kwargs = dict(kwargs, sensitivity=sens)
        want, stats = one_part_weights(lp, adv, mask, scope="step", **kwargs)
        b0 = d0[0].shape[0]
        for r, (rows, d) in enumerate(((slice(0, b0), d0), (slice(b0, None), d1))):
            local = want[rows, : d[0].shape[1]]
            m = d[2]
            assert torch.equal(got[r][f"w{i}"][m], local[m]), (i, r)
            assert torch.equal(got[r][f"wparts{i}"][m], local[m]), (i, r)
            assert (got[r][f"w{i}"][~m] == 1).all()
        assert got[0][f"sel_pos{i}"] + got[1][f"sel_pos{i}"] == stats.selected_pos
        assert (want != 1).any()
    for n0, n1 in ((4, 0), (0, 0), (1, 3)):
        expect = torch.cat([torch.arange(n0, dtype=torch.float32), torch.arange(n1, dtype=torch.float32) + 10])
        for r in range(2):
            assert torch.equal(got[r][f"gather_{n0}_{n1}"], expect)
