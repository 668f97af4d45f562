"""The reference trainer's balancing (rows dealt to ranks, micro-batches cut), against a transcription of its
procedures, and in the runner, on one process and on two gloo ranks.

The transcription below follows the reference driver's ``balance_batch`` and its actor's dynamic batching step
by step, written independently of ``step/partition.py``: the costs, the largest differencing method run on a
plain list (the two partial partitions of widest spread, then heaviest largest part, merged until one is left;
``equal_size`` seeds each partial partition with the next k items, one per part), rows sorted inside each part,
then the driver's light-at-both-ends order per rank and the actor's count rule and heaviest-in-the-middle order.
"""

from __future__ import annotations

import math
import random
from functools import cmp_to_key

import pytest
import torch

from stare_lightning.algorithms import AlgorithmConfig, STAREConfig
from stare_lightning.rollout.config import RolloutConfig
from stare_lightning.step.batch import concatenate
from stare_lightning.step.config import ForwardConfig
from stare_lightning.step.partition import balanced_partition, differencing_partition, rank_partition
from stare_lightning.step.plan import StepPlan
from stare_lightning.step.runner import StepRunner
from tests.distributed import run_on_ranks
from tests.experiences import on_policy_experience
from tests.test_step_runner import GradientRecorder, _collection


def _cost(n: int) -> int:
    return 24576 * n + n * n


def _reference_differencing(cost: list[int], count: int, equal_size: bool) -> list[list[int]]:
    def part_key(part):  # a part: list of (row, cost) in the order they joined
        return (sum(c for _, c in part), len(part), part)

    def spread(state):
        return part_key(state[0])[0] - part_key(state[-1])[0]

    def before(a, b):  # -1 when state a is taken before state b
        if spread(a) != spread(b):
            return -1 if spread(a) > spread(b) else 1
        return -1 if part_key(a[0]) > part_key(b[0]) else 1

    ascending = sorted((c, row) for row, c in enumerate(cost))
    step = count if equal_size else 1
    states = []
    for start in range(0, len(ascending), step):
        seeds = [[(row, c)] for c, row in ascending[start : start + step]]
        states.append(sorted(seeds + [[] for _ in range(count - len(seeds))], key=part_key, reverse=True))
    while len(states) > 1:
        states.sort(key=cmp_to_key(before))
        a, b = states.pop(0), states.pop(0)
        merged = [a[i] + b[count - 1 - i] for i in range(count)]
        states.append(sorted(merged, key=part_key, reverse=True))
    return [sorted(row for row, _ in part) for part in states[0]]


def _reference_partition(lengths: list[int], budget: int) -> list[list[int]]:
    """The actor's dynamic batch size: micro-batches of one mini-batch, in the order they run."""
    count = min(len(lengths), math.ceil(sum(lengths) / budget))
    cost = [_cost(n) for n in lengths]
    parts = _reference_differencing(cost, count, equal_size=False)
    parts.sort(key=lambda part: (sum(cost[r] for r in part), part[0]), reverse=True)
    return parts[::2][::-1] + parts[1::2]


def _reference_balance_batch(lengths: list[int], ranks: int) -> list[list[int]]:
    """The driver's balance_batch: each rank's rows of the step, in the order the rank receives them."""
    cost = [_cost(n) for n in lengths]
    dealt = []
    for part in _reference_differencing(cost, ranks, equal_size=True):
        part.sort(key=lambda row: (cost[row], row))
        dealt.append(part[::2] + part[1::2][::-1])
    return dealt


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


@pytest.mark.parametrize("seed", range(30))
def test_rows_are_dealt_to_ranks_as_the_reference_deals_them(seed):
    rng = random.Random(100 + seed)
    ranks = rng.choice([1, 2, 3, 4, 8])
    rows = ranks * rng.randint(1, 12)
    lengths = [rng.choice([rng.randint(5, 300), 64, 128]) for _ in range(rows)]
    got = rank_partition(lengths, ranks)
    assert got == _reference_balance_batch(lengths, ranks)
    assert sorted(r for part in got for r in part) == list(range(rows))
    assert {len(part) for part in got} == {rows // ranks}


@pytest.mark.parametrize("rows,ranks", [(7, 2), (10, 4), (9, 8), (3, 2)])
def test_a_remainder_is_dealt_one_row_more_to_some_ranks(rows, ranks):
    rng = random.Random(rows * ranks)
    lengths = [rng.randint(5, 300) for _ in range(rows)]
    got = rank_partition(lengths, ranks)
    assert sorted(r for part in got for r in part) == list(range(rows))
    assert {len(part) for part in got} == {rows // ranks, rows // ranks + 1}
    # Light rows at both ends, heavy in the middle, on every rank.
    for part in got:
        costs = [_cost(lengths[r]) for r in part]
        peak = costs.index(max(costs))
        assert costs[: peak + 1] == sorted(costs[: peak + 1]) and costs[peak:] == sorted(costs[peak:], reverse=True)


def test_differencing_balances_better_than_consecutive_rows():
    values = [9, 8, 7, 6, 5, 4, 3, 2, 1, 1]
    parts = differencing_partition(values, 3)
    sums = sorted(sum(values[i] for i in part) for part in parts)
    assert sums[-1] - sums[0] <= 1  # 46 over three parts: 15, 15, 16
    with pytest.raises(ValueError, match="cannot split 2 items into 3"):
        differencing_partition([1, 2], 3)
    with pytest.raises(ValueError, match="cannot split 5 items into 2 parts of equal size"):
        differencing_partition([1, 2, 3, 4, 5], 2, equal_size=True)


def test_concatenated_batches_keep_every_row_and_the_layout():
    """Rows of batches with different prompt and response widths, joined: each row's tokens and per-token fields
    are where the layout puts them, and nothing else is attended."""
    g = torch.Generator().manual_seed(1)
    shapes = [((3, 5), (4, 1)), ((7, 2, 2), (9, 3, 6))]
    batches, rows = [], []
    for prompt_lengths, response_lengths in shapes:
        prompts = [torch.randint(3, 50, (n,), generator=g).tolist() for n in prompt_lengths]
        responses = [torch.randint(3, 50, (n,), generator=g).tolist() for n in response_lengths]
        advantages = torch.randn(len(prompts), generator=g)
        batches.append(on_policy_experience(prompts, responses, advantages, n=1))
        rows += list(zip(prompts, responses, advantages.tolist()))
    joined = concatenate(batches, pad_token_id=0)
    assert joined.prompt_width == 7 and joined.response_width == 9 and joined.num_rows == 5
    for i, (prompt, response, advantage) in enumerate(rows):
        attended = joined.input_ids[i][joined.attention_mask[i].bool()].tolist()
        assert attended == prompt + response
        assert joined.response_ids[i, : len(response)].tolist() == response
        assert joined.response_mask[i].tolist() == [True] * len(response) + [False] * (9 - len(response))
        assert joined.rollout_logprobs[i].tolist() == [-1.0] * len(response) + [0.0] * (9 - len(response))
        assert joined.advantages[i].item() == pytest.approx(advantage)
    assert type(joined) is type(batches[0])


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


def _runner_rows(vocab: int, lengths_seed: int = 4):
    g = torch.Generator().manual_seed(lengths_seed)
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (3, 3, 5, 5, 4, 4, 6, 6, 3, 3)]
    responses = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (7, 2, 9, 4, 12, 5, 3, 8, 11, 1)]
    advantages = torch.tensor([0.8, -0.8, 0.5, -0.5, 1.0, -1.0, 0.3, -0.3, 0.6, -0.6])
    return prompts, responses, advantages


def _balanced_step(policy, prompts, responses, advantages, budget: int = 30):
    """One official-semantics STARE step (selection inside each micro-batch, gate open) on these rows."""
    batch = on_policy_experience(prompts, responses, advantages, n=2)
    stare = STAREConfig(enabled=True, scope="micro_batch", target_entropy=100.0, top_ratio=0.25,
                        k_rounding="reference", tie_order="topk")  # fmt: skip
    alg = AlgorithmConfig(stare=stare, update={"micro_batch_partition": "balanced", "loss_normalizer": "micro_batch"})
    plan = StepPlan.resolve(alg, RolloutConfig(n=2), ForwardConfig(micro_batch_tokens=budget))
    runner = StepRunner(plan, verifiers=None, sampling=None, pad_token_id=0, policy=policy,
                        optimizer_step=GradientRecorder(policy), controller=stare.make_controller())  # fmt: skip
    return runner.learn(_collection(batch), seed=0), stare


def _check_micro_batches(result, want, prompts, responses, advantages, before_update, w) -> int:
    """Each micro-batch of ``result`` holds the rows of ``want`` (lists of row indices) in their order, and its
    selection is the reference's L+ and L- of those rows; returns how many L+ tokens were selected."""
    assert [float(s["tokens"]) for s in result.micro_batch_sums] == [
        float(sum(len(responses[r]) for r in part)) for part in want
    ]
    assert len(result.selections) == len(want)  # one selection inside each micro-batch
    selected_positive = 0
    for part, selection in zip(want, result.selections):
        logprobs = [_response_logprobs(before_update, prompts[r], responses[r]) for r in part]
        signs = [float(advantages[r]) for r in part]
        assert selection.advantages.tolist() == pytest.approx(signs)
        l_plus, l_minus = (_reference_selection(logprobs, signs, top_ratio=0.25, sign=s) for s in (1, -1))
        for i, (plus, minus) in enumerate(zip(l_plus, l_minus)):
            width, where = len(plus), f"micro-batch {part}, row {part[i]}"
            picked = selection.selected[i, :width]
            assert torch.equal(picked & (selection.advantages[i] > 0), plus), where
            assert torch.equal(picked & (selection.advantages[i] < 0), minus), where
            assert not selection.selected[i, width:].any()
            # O1 with the gate open: W on L+, every other token 1.
            assert torch.equal(selection.omega[i, :width], torch.where(plus, w, 1.0)), where
        selected_positive += sum(int(m.sum()) for m in l_plus)
    return selected_positive


def _reference_micro_batches(lengths: list[int], dealt: list[int], budget: int) -> list[list[int]]:
    """The actor's micro-batches of the rows ``dealt`` to one rank (in that order), as indices of all rows."""
    return [[dealt[i] for i in part] for part in _reference_partition([lengths[r] for r in dealt], budget)]


def test_the_runner_partitions_and_selects_as_the_reference(tiny_dir):
    """With ``micro_batch_partition=balanced`` on one process the rows are ordered as ``balance_batch`` orders
    them, each micro-batch of the update holds the rows the reference procedure puts together, in its order
    (the per-micro-batch token counts and advantages say so), and the tokens STARE selects inside each are the
    reference's top-P surprisal set of that micro-batch's rows."""
    import copy

    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    policy = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    prompts, responses, advantages = _runner_rows(policy.config.vocab_size)
    before_update = copy.deepcopy(policy)
    result, stare = _balanced_step(policy, prompts, responses, advantages)
    lengths = [len(p) + len(r) for p, r in zip(prompts, responses)]
    (dealt,) = _reference_balance_batch(lengths, 1)
    assert dealt != sorted(dealt)  # the order matters to the test
    assert result.batch.advantages.tolist() == pytest.approx(advantages[dealt].tolist())
    want = _reference_micro_batches(lengths, dealt, 30)
    assert len(want) >= 3
    assert _check_micro_batches(result, want, prompts, responses, advantages, before_update, stare.w) > 0


def test_balanced_mini_batches_take_the_dealt_rows_in_order(tiny_dir):
    """With two mini-batches the reference actor splits the rows it was dealt as they come: the first optimizer
    step trains on the first half of ``balance_batch``'s order, the second on the rest, each cut as the actor
    cuts it."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    policy = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    prompts, responses, advantages = _runner_rows(policy.config.vocab_size)
    batch = on_policy_experience(prompts, responses, advantages, n=2)
    alg = AlgorithmConfig(
        update={"mini_batches": 2, "micro_batch_partition": "balanced", "loss_normalizer": "micro_batch"}
    )
    plan = StepPlan.resolve(alg, RolloutConfig(n=2), ForwardConfig(micro_batch_tokens=25))
    recorder = GradientRecorder(policy, lr=0.1)
    runner = StepRunner(plan, verifiers=None, sampling=None, pad_token_id=0, policy=policy,
                        optimizer_step=recorder)  # fmt: skip
    result = runner.learn(_collection(batch), seed=3)
    lengths = [len(p) + len(r) for p, r in zip(prompts, responses)]
    (dealt,) = _reference_balance_batch(lengths, 1)
    want = _reference_micro_batches(lengths, dealt[:5], 25) + _reference_micro_batches(lengths, dealt[5:], 25)
    assert len(recorder.grads) == 2
    assert [float(s["tokens"]) for s in result.micro_batch_sums] == [
        float(sum(len(responses[r]) for r in part)) for part in want
    ]
    assert len(set(map(len, want))) > 1  # micro-batches of different sizes: the counts tell partitions apart


def _balanced_rank_step(rank: int, world: int, tiny_dir: str, rows_of_rank: list[list[int]]) -> dict:
    import copy

    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    policy = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    prompts, responses, advantages = _runner_rows(policy.config.vocab_size)
    before_update = copy.deepcopy(policy)
    mine = rows_of_rank[rank]
    result, stare = _balanced_step(
        policy, [prompts[i] for i in mine], [responses[i] for i in mine], advantages[mine], budget=20
    )
    # Every rank's rows in rank order are the step's batch, indexed as the reference driver indexes it.
    step_rows = [row for rows in rows_of_rank for row in rows]
    lengths = [len(prompts[r]) + len(responses[r]) for r in step_rows]
    dealt = [step_rows[i] for i in _reference_balance_batch(lengths, world)[rank]]
    all_lengths = [len(p) + len(r) for p, r in zip(prompts, responses)]
    want = _reference_micro_batches(all_lengths, dealt, 20)
    # The actor's count is the largest of any rank's: recompute it as the rank with the most would.
    counts = []
    for other in _reference_balance_batch(lengths, world):
        rows = [lengths[i] for i in other]
        counts.append(min(len(rows), math.ceil(sum(rows) / 20)))
    assert max(counts) == len(want), "this batch must not need fillers for the check below"
    received = [float(a) for a in result.batch.advantages]
    selected = _check_micro_batches(result, want, prompts, responses, advantages, before_update, stare.w)
    return {"dealt": dealt, "received": received, "selected": selected}


@pytest.mark.slow
def test_two_ranks_deal_rows_by_workload_then_partition_and_select_as_the_reference(tiny_dir, tmp_path):
    """Two gloo ranks holding very unequal rows: after ``balance_batch`` each trains on the reference's half of
    the step (rows moved across ranks with their advantages), cut and selected as the reference would."""
    rows_of_rank = [[4, 5, 8, 9, 2, 3], [0, 1, 6, 7]]  # whole groups of two; rank 0: 66 tokens, rank 1: 38
    ranks = run_on_ranks(_balanced_rank_step, tmp_path, str(tiny_dir), rows_of_rank)
    _, _, advantages = _runner_rows(64)
    moved = set(ranks[0]["dealt"]) - set(rows_of_rank[0])
    assert moved, "the test's batch must make rows change ranks"
    assert sorted(ranks[0]["dealt"] + ranks[1]["dealt"]) == list(range(10))
    for rank in (0, 1):
        assert ranks[rank]["received"] == pytest.approx(advantages[ranks[rank]["dealt"]].tolist())
    assert ranks[0]["selected"] + ranks[1]["selected"] > 0
