"""One process of a two-process TRL run with STARE (started by tests/test_integrations_trl_distributed.py under
``torch.distributed.run``, gloo on the CPU): for each scope in turn (a comma-separated list, one fresh trainer each,
the processes' group shared), each process trains on its own fixed rollouts, and saves its batches, the parameters
they were scored with, its weights and the optimizer steps' gradients (averaged over the processes) to
``OUT/<scope>/rank<r>.pt``.

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/trl_two_processes.py TINY OUT SCOPES
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from tests.trl_harness import SETTINGS, trainer_for, weights_of

STEPS = 2
KEYS = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "advantages")


def main(tiny_dir: str, out_dir: str, scopes: str) -> None:
    for scope in scopes.split(","):
        train(tiny_dir, f"{out_dir}/{scope}", scope)


def train(tiny_dir: str, out_dir: str, scope: str) -> None:
    settings = {**SETTINGS, "scope": scope, "target_entropy": 100.0}  # the gate open at every step
    rank = int(__import__("os").environ["RANK"])
    trainer, gradients = trainer_for(
        tiny_dir, out_dir, settings, steps=STEPS, place_targets=False, seed=11 + rank, ddp_backend="gloo"
    )
    trainer.train()
    assert dist.is_initialized() and dist.get_world_size() == 2
    batches = [{**{k: b[k] for k in KEYS}, "weights": weights_of(b)} for b in trainer.batches]
    metrics = [{k: v for k, v in row.items() if k.startswith("stare/")} for row in trainer.state.log_history[:STEPS]]
    record = {"batches": batches, "params": trainer.params, "gradients": gradients.steps, "metrics": metrics}
    torch.save(record, f"{out_dir}/rank{rank}.pt")


if __name__ == "__main__":
    main(*sys.argv[1:4])
