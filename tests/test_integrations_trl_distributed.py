"""STARE in TRL on two processes (accelerate over gloo, on the CPU; tests/trl_two_processes.py): with scope "step"
the selection and the gate's entropy are gathered across the processes, with scope "group" each group is ranked
where it lies; either way each process's weights, and the optimizer steps' gradients averaged over the processes,
equal this project's step on the two processes' rows as one batch."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.nn.functional import pad

from tests.trl_harness import SETTINGS, replay

# isort: split
from tests.trl_two_processes import STEPS

REPO = Path(__file__).resolve().parents[1]
# One pair of processes runs both scopes (a fresh trainer each), so one xdist worker runs both tests.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("trl_two_processes")]
SCOPES = ["step", "group"]


@pytest.fixture(scope="module")
def two_process_runs(tiny_dir, tmp_path_factory) -> Path:
    """TRL's loop on two processes, once per scope: ``<dir>/<scope>/rank<r>.pt``."""
    out_dir = tmp_path_factory.mktemp("trl_two_processes")
    env = {**os.environ, "PYTHONPATH": str(REPO), "TRL_EXPERIMENTAL_SILENCE": "1", "OMP_NUM_THREADS": "1"}
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    command = [*launcher, str(REPO / "tests" / "trl_two_processes.py"), str(tiny_dir), str(out_dir), ",".join(SCOPES)]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out_dir


def _joined(parts: list[dict]) -> dict:
    """The processes' rows as one batch, in rank order, completions right-padded to the widest."""
    width = max(p["completion_ids"].shape[1] for p in parts)
    out = {}
    for key in ("prompt_ids", "prompt_mask", "advantages"):
        out[key] = torch.cat([p[key] for p in parts])
    for key in ("completion_ids", "completion_mask"):
        out[key] = torch.cat([pad(p[key], (0, width - p[key].shape[1])) for p in parts])
    return out


@pytest.mark.parametrize("scope", SCOPES)
def test_two_processes_equal_the_projects_step_on_their_rows(tiny_dir, two_process_runs, scope):
    ranks = [torch.load(two_process_runs / scope / f"rank{rank}.pt") for rank in (0, 1)]
    batches = [_joined([r["batches"][step] for r in ranks]) for step in range(STEPS)]
    settings = {**SETTINGS, "scope": scope, "target_entropy": 100.0}
    theirs = replay(tiny_dir, batches, ranks[0]["params"], [None] * STEPS, settings)
    for step, want in enumerate(theirs):
        assert want.params.gate_on
        start = 0
        for r in ranks:
            weights = r["batches"][step]["weights"]
            rows, width = weights.shape
            assert torch.equal(weights, want.omega[start : start + rows, :width])
            start += rows
            assert r["metrics"][step]["stare/gate_entropy"] == pytest.approx(want.params.gate_entropy, rel=1e-6)
        for name, grad in want.grads.items():
            torch.testing.assert_close(ranks[0]["gradients"][step][name], grad, atol=2e-6, rtol=1e-4)
            torch.testing.assert_close(ranks[1]["gradients"][step][name], grad, atol=2e-6, rtol=1e-4)
    # Control: the processes held different rows; with scope "step" the selection over one process's rows alone
    # differs from the one applied (it was made over both), with scope "group" it is the same.
    assert not torch.equal(ranks[0]["batches"][0]["completion_ids"], ranks[1]["batches"][0]["completion_ids"])
    first = ranks[0]["batches"][0]
    alone = replay(tiny_dir, [first], ranks[0]["params"][:1], [None], settings)[0]
    assert torch.equal(alone.omega, first["weights"]) == (scope == "group")
