"""The scoring pass from logits the same-batch telemetry already holds equals the scoring pass's own forward; a
sharded policy scores ranks that hold different numbers of micro-batches."""

from __future__ import annotations

import dataclasses

import torch

from stare_lightning.step.scoring import response_logits, score_batch, scores_from_logits
from tests.distributed import run_on_ranks
from tests.test_official_semantics import TEMPERATURE, fixed_batch


def test_scores_from_held_logits_equal_a_fresh_scoring_pass(tiny_dir):
    from transformers import AutoModelForCausalLM

    policy = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    batch = fixed_batch(policy.config.vocab_size)
    kwargs = dict(temperature=TEMPERATURE, chunk_size=5, micro_batch_tokens=40)
    fresh = score_batch(policy, batch, **kwargs)
    held = scores_from_logits(response_logits(policy, batch, micro_batch_tokens=40), batch, **kwargs)
    for field in dataclasses.fields(fresh):
        assert torch.equal(getattr(fresh, field.name), getattr(held, field.name)), field.name


def _sharded_scores(rank: int, world: int, tiny_dir: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM

    from stare_lightning.models.sharding import shard_model
    from stare_lightning.step.scoring import forwards_in_step

    policy = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    batch = fixed_batch(policy.config.vocab_size)
    mine = batch.select(slice(0, 8) if rank == 0 else slice(0, 1))  # rank 1: one short row, one micro-batch
    unsharded = score_batch(policy, mine, temperature=TEMPERATURE, chunk_size=5, micro_batch_tokens=20)
    shard_model(policy, init_device_mesh("cpu", (world,), mesh_dim_names=("data_parallel",)))
    parts, real = forwards_in_step(mine, 20, packed=False)
    sharded = score_batch(policy, mine, temperature=TEMPERATURE, chunk_size=5, micro_batch_tokens=20)
    logits = response_logits(policy, mine, micro_batch_tokens=20)
    return {"forwards": len(parts), "real": real, "logits": len(logits), "unsharded": unsharded, "sharded": sharded}


def test_a_sharded_policy_scores_ranks_with_different_micro_batch_counts(tiny_dir, tmp_path):
    """FSDP2 gathers each layer's parameters in every forward, so the no-grad passes must run as many forwards on
    every rank: the rank with fewer micro-batches runs fillers (dropped), and each rank's scores are its rows'."""
    ranks = run_on_ranks(_sharded_scores, tmp_path, str(tiny_dir))
    assert ranks[0]["real"] > ranks[1]["real"] == 1
    assert ranks[0]["forwards"] == ranks[1]["forwards"] == ranks[0]["real"]
    for rank in (0, 1):
        assert ranks[rank]["logits"] == ranks[rank]["real"]
        for field in dataclasses.fields(ranks[rank]["unsharded"]):
            want, got = getattr(ranks[rank]["unsharded"], field.name), getattr(ranks[rank]["sharded"], field.name)
            assert torch.allclose(got, want, atol=1e-5, rtol=1e-4), (rank, field.name)
