"""A weight holding NaN or inf is refused as the trainer gathers it for the rollout servers (rollout/weights.py's
``finite_weights`` in ``ServerRolloutEngine.gather_weights``): over two FSDP2 ranks where only rank 1's shard holds
the NaN, both ranks refuse at the same tensor, naming it and the step, and neither is left inside a collective."""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_on_ranks


def _refuse_on_ranks(rank: int, world: int) -> tuple[bool, str, float]:
    from torch.distributed.fsdp import fully_shard

    from stare_lightning.rollout.server.trainer_side.client import ServerClient
    from stare_lightning.rollout.server.trainer_side.engine import ServerRolloutEngine
    from stare_lightning.rollout.weights import NonFiniteWeights

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    with torch.no_grad():
        shard = model[1].weight.to_local()
        if rank == 1:
            shard.view(-1)[0] = float("nan")
        own_shard_finite = bool(torch.isfinite(model[1].weight.to_local()).all())
    # Never contacted: gathering the weights needs no server.
    engine = ServerRolloutEngine([ServerClient("http://127.0.0.1:9", token=None, timeout=1)], chunk_bytes=1 << 20)
    try:
        engine.gather_weights(model, policy="the policy after step 5")
        message = "not refused"
    except NonFiniteWeights as error:
        message = str(error)
    reached = torch.ones(1)
    torch.distributed.all_reduce(reached)  # every rank gets here: none was left waiting inside a gather
    return own_shard_finite, message, reached.item()


@pytest.mark.slow
def test_every_rank_refuses_a_non_finite_weight_at_the_same_tensor(tmp_path):
    results = run_on_ranks(_refuse_on_ranks, tmp_path)
    assert results[0][0] and not results[1][0]  # the control: rank 0's own shard is finite, only the gather shows NaN
    messages = {rank: message for rank, (_, message, _) in results.items()}
    assert messages[0] == messages[1]
    assert messages[0].startswith("weight '1.weight' of the policy after step 5 holds 1 non-finite values"), messages
    assert all(reached == 2.0 for _, _, reached in results.values())
