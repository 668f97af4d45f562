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


def _reference_selection(
    logprobs: list[torch.Tensor], advantages: list[float], top_ratio: float, sign: int
) -> list[torch.Tensor]:
    """The reference's L+ (sign 1) or L- (sign -1) inside one micro-batch: of the tokens whose advantage has that
    sign, the max(1, int(n P + 0.999999)) of highest surprisal -log pi (one mask per row)."""
    surprisal = torch.cat([-lp for lp in logprobs])
    candidate = torch.cat([torch.full_like(lp, a * sign > 0, dtype=torch.bool) for lp, a in zip(logprobs, advantages)])
    selected = torch.zeros_like(candidate)
    n = int(candidate.sum())
    if n:
        k = min(n, max(1, int(n * top_ratio + 0.999999)))
        selected[candidate.nonzero().squeeze(-1)[torch.topk(surprisal[candidate], k).indices]] = True
    return list(selected.split([len(lp) for lp in logprobs]))


def _response_logprobs(policy, prompt: list[int], response: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = policy(torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1].float()
    return logits.log_softmax(-1).gather(-1, torch.tensor(response)[:, None])[:, 0]


def test_the_runner_partitions_and_selects_as_the_reference(tiny_dir):
    """With ``micro_batch_partition=balanced`` each micro-batch of the update holds the rows the reference
    procedure puts together, in its order (the per-micro-batch token counts the runner reports say so), and the
    tokens STARE selects inside each are the reference's top-P surprisal set of that micro-batch's rows."""
    import copy

    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    policy = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    g = torch.Generator().manual_seed(4)
    vocab = policy.config.vocab_size
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (3, 3, 5, 5, 4, 4, 6, 6, 3, 3)]
    responses = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (7, 2, 9, 4, 12, 5, 3, 8, 11, 1)]
    advantages = torch.tensor([0.8, -0.8, 0.5, -0.5, 1.0, -1.0, 0.3, -0.3, 0.6, -0.6])
    batch = on_policy_experience(prompts, responses, advantages, n=2)
    stare = STAREConfig(enabled=True, scope="micro_batch", target_entropy=100.0, top_ratio=0.25, k_rounding="reference")
    alg = AlgorithmConfig(stare=stare, micro_batch_partition="balanced", loss_normalizer="micro_batch")
    before_update = copy.deepcopy(policy)
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
    selected_positive = 0
    for part, selection in zip(want, result.selections):
        logprobs = [_response_logprobs(before_update, prompts[r], responses[r]) for r in part]
        signs = [float(advantages[r]) for r in part]
        l_plus, l_minus = (_reference_selection(logprobs, signs, top_ratio=0.25, sign=s) for s in (1, -1))
        for i, (plus, minus) in enumerate(zip(l_plus, l_minus)):
            width, where = len(plus), f"micro-batch {part}, row {part[i]}"
            picked = selection.selected[i, :width]
            assert torch.equal(picked & (selection.advantages[i] > 0), plus), where
            assert torch.equal(picked & (selection.advantages[i] < 0), minus), where
            assert not selection.selected[i, width:].any()
            # O1 with the gate open: W on L+, every other token 1.
            assert torch.equal(selection.omega[i, :width], torch.where(plus, stare.w, 1.0)), where
        selected_positive += sum(int(m.sum()) for m in l_plus)
    assert selected_positive > 0
