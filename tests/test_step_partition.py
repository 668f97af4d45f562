"""The reference trainer's micro-batch partition, against a transcription of its procedure, and in the runner.

The transcription below follows the reference actor's dynamic batching step by step, written independently of
``step/partition.py``: the count rule, the costs, the largest differencing method run on a plain list (the two
partial partitions of widest spread, then heaviest largest part, merged until one is left), rows sorted inside
each part, and the heaviest-in-the-middle order.
"""

from __future__ import annotations

import math
import random
from functools import cmp_to_key

import pytest
import torch

from stare_lightning.algorithms import AlgorithmConfig, STAREConfig
from stare_lightning.rollout.config import RolloutConfig
from stare_lightning.step.config import ForwardConfig
from stare_lightning.step.partition import balanced_partition, differencing_partition
from stare_lightning.step.plan import StepPlan
from stare_lightning.step.runner import StepRunner
from tests.experiences import on_policy_experience
from tests.test_step_runner import GradientRecorder, _collection


def _reference_partition(lengths: list[int], budget: int) -> list[list[int]]:
    count = min(len(lengths), math.ceil(sum(lengths) / budget))
    cost = [24576 * n + n * n for n in lengths]

    def part_key(part):  # a part: list of (row, cost) in the order they joined
        return (sum(c for _, c in part), len(part), part)

    def spread(state):
        return part_key(state[0])[0] - part_key(state[-1])[0]

    def before(a, b):  # -1 when state a is taken before state b
        if spread(a) != spread(b):
            return -1 if spread(a) > spread(b) else 1
        return -1 if part_key(a[0]) > part_key(b[0]) else 1

    states = []
    for c, row in sorted((c, row) for row, c in enumerate(cost)):
        states.append(sorted([[(row, c)]] + [[] for _ in range(count - 1)], key=part_key, reverse=True))
    while len(states) > 1:
        states.sort(key=cmp_to_key(before))
        a, b = states.pop(0), states.pop(0)
        merged = [a[i] + b[count - 1 - i] for i in range(count)]
        states.append(sorted(merged, key=part_key, reverse=True))
    parts = [sorted(row for row, _ in part) for part in states[0]]
    parts.sort(key=lambda part: (sum(cost[r] for r in part), part[0]), reverse=True)
    return parts[::2][::-1] + parts[1::2]


@pytest.mark.parametrize("seed", range(40))
def test_the_partition_is_the_reference_procedures(seed):
    rng = random.Random(seed)
    rows = rng.randint(1, 40)
    # Lengths with many repeats (padded-to-budget responses) as well as spread ones.
    lengths = [rng.choice([rng.randint(5, 300), 64, 128]) for _ in range(rows)]
    budget = rng.randint(max(lengths), max(lengths) * 6)
    got = balanced_partition(lengths, budget)
    assert got == _reference_partition(lengths, budget)
    assert sorted(r for part in got for r in part) == list(range(rows))  # every row once
    assert len(got) == min(rows, math.ceil(sum(lengths) / budget))


def test_differencing_balances_better_than_consecutive_rows():
    values = [9, 8, 7, 6, 5, 4, 3, 2, 1, 1]
    parts = differencing_partition(values, 3)
    sums = sorted(sum(values[i] for i in part) for part in parts)
    assert sums[-1] - sums[0] <= 1  # 46 over three parts: 15, 15, 16
    with pytest.raises(ValueError, match="cannot split 2 items into 3"):
        differencing_partition([1, 2], 3)


def test_the_runner_updates_over_the_balanced_micro_batches(tiny_dir):
    """With ``micro_batch_partition=balanced`` each micro-batch of the update holds the rows the reference
    procedure puts together, in its order: the per-micro-batch token counts the runner reports say so."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    policy = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    g = torch.Generator().manual_seed(4)
    vocab = policy.config.vocab_size
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (3, 3, 5, 5, 4, 4, 6, 6, 3, 3)]
    responses = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (7, 2, 9, 4, 12, 5, 3, 8, 11, 1)]
    advantages = torch.tensor([0.8, -0.8, 0.5, -0.5, 1.0, -1.0, 0.3, -0.3, 0.6, -0.6])
    batch = on_policy_experience(prompts, responses, advantages, n=2)
    stare = STAREConfig(enabled=True, scope="micro_batch", target_entropy=100.0)
    alg = AlgorithmConfig(stare=stare, micro_batch_partition="balanced", loss_normalizer="micro_batch")
    plan = StepPlan.resolve(alg, RolloutConfig(n=2), ForwardConfig(micro_batch_tokens=30))
    runner = StepRunner(plan, alg, verifiers=None, sampling=None, pad_token_id=0, policy=policy,
                        optimizer_step=GradientRecorder(policy), controller=stare.make_controller())  # fmt: skip
    result = runner.learn(_collection(batch), seed=0)
    lengths = [len(p) + len(r) for p, r in zip(prompts, responses)]
    want = _reference_partition(lengths, 30)
    assert len(want) >= 3 and [float(s["tokens"]) for s in result.micro_batch_sums] == [
        float(sum(len(responses[r]) for r in part)) for part in want
    ]
    assert len(result.selections) == len(want)  # one selection inside each micro-batch
