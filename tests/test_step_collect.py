"""Collection with a scripted engine: rewards, advantages, and dynamic sampling's refill, budget and global filter.

The engine returns responses written in advance for each (generation batch, prompt), so every reward is
known; verification runs in the real verifier pool ("exact" verifier: a response is correct when it reads
"yes").
"""

from __future__ import annotations

import pytest
import torch

from stare_lightning.algorithms import AlgorithmConfig
from stare_lightning.rewards import VerifierPool
from stare_lightning.rollout.base import Rollouts, SamplingParams
from stare_lightning.step.collect import collect

N = 4


class ScriptedEngine:
    """Answers prompt ``id`` of generation batch ``b`` with ``script[(b, id)]`` (N texts); records every call."""

    holds_weight_copy = False

    def __init__(self, script: dict[tuple[int, str], list[str]]) -> None:
        self.script = script
        self.calls: list[tuple[list[list[int]], list[int]]] = []

    def generate(self, prompt_ids, params, seeds=None) -> Rollouts:
        batch = len(self.calls)
        self.calls.append((prompt_ids, list(seeds)))
        texts = [t for ids in prompt_ids for t in self.script[(batch, _id_of(ids))]]
        responses = [[ord(c) for c in t] or [0] for t in texts]
        return Rollouts(
            prompt_ids=[ids for ids in prompt_ids for _ in range(params.n)],
            response_ids=responses,
            response_logprobs=[[-0.5] * len(r) for r in responses],
            texts=texts,
            finish_reasons=["length" if len(t) > params.max_new_tokens else "stop" for t in texts],
            n=params.n,
            generation_seconds=0.25,
        )


def _item(record_id: str) -> dict:
    return {"id": record_id, "prompt_ids": [ord(c) for c in record_id], "verifier": "exact", "answer": "yes"}


def _id_of(prompt_ids: list[int]) -> str:
    return "".join(chr(i) for i in prompt_ids)


MIXED, ALL_RIGHT, ALL_WRONG = ["yes", "no", "yes", "no"], ["yes"] * N, ["no"] * N


@pytest.fixture(scope="module")
def pool():
    with VerifierPool() as pool:
        yield pool


# The collection switches of the reference code's side (the *_official algorithm recipes).
OFFICIAL = {"dynamic_sampling_metric": "score", "budget_exhausted": "stop"}


def _collect(pool, engine, items, more=None, **collection):
    cfg = AlgorithmConfig(collection=collection)
    return collect(
        items,
        engine,
        pool,
        SamplingParams(n=N, max_new_tokens=8),
        cfg.collection,
        cfg.advantage,
        pad_token_id=0,
        more_prompts=more,
        seed=7,
    )


def test_one_batch_without_dynamic_sampling_keeps_every_group(pool):
    engine = ScriptedEngine({(0, "a"): MIXED, (0, "b"): ALL_RIGHT})
    got = _collect(pool, engine, [_item("a"), _item("b")], dynamic_sampling=False)
    assert len(engine.calls) == 1 and [i["id"] for i in got.items] == ["a", "b"]
    assert got.correct.tolist() == [[1.0, 0.0, 1.0, 0.0], [1.0] * N]
    # GRPO advantages by hand: (r - mean) / (unbiased std + eps) per group; zero for the agreeing group.
    mixed = torch.tensor([1.0, 0.0, 1.0, 0.0])
    want = (mixed - mixed.mean()) / (mixed.std() + 1e-6)
    assert torch.allclose(got.batch.advantages[:N], want) and torch.all(got.batch.advantages[N:] == 0)
    assert got.stats.generation_batches == 1 and got.stats.generated_tokens == sum(len(t) for t in MIXED + ALL_RIGHT)
    assert [z.tolist() for z in got.stats.zero_std_groups] == [[False, True]]
    assert got.texts == MIXED + ALL_RIGHT


def test_dynamic_sampling_refills_past_zero_variance_groups(pool):
    script = {
        (0, "a"): ALL_RIGHT,
        (0, "b"): MIXED,
        (0, "c"): ALL_WRONG,
        (1, "d"): ALL_WRONG,
        (1, "e"): ["no", "yes", "no", "no"],
        (1, "f"): MIXED,
    }
    engine = ScriptedEngine(script)
    asked = []

    def more(count, attempt):
        asked.append((count, attempt))
        return [_item(x) for x in "def"]

    got = _collect(pool, engine, [_item(x) for x in "abc"], more=more, dynamic_sampling=True, max_generation_batches=5)
    # b from the first batch, then e and f from the second: the target of three groups is met, no third batch.
    assert [i["id"] for i in got.items] == ["b", "e", "f"] and asked == [(3, 1)]
    assert got.stats.generation_batches == 2
    assert [z.tolist() for z in got.stats.zero_std_groups] == [[True, False, True], [True, False, False]]
    assert all(got.batch.advantages.view(3, N).std(-1) > 0)
    assert got.batch.num_rows == 3 * N and got.texts[N : 2 * N] == script[(1, "e")]
    # Rewards of every generated group (kept or not) are reported, batch by batch.
    assert [r.sum().item() for r in got.stats.generated_rewards] == [6.0, 3.0]


def test_dynamic_sampling_stops_at_its_budget_and_keeps_the_last_batch(pool):
    script = {(b, x): ALL_WRONG for b in range(3) for x in "ab"}
    engine = ScriptedEngine(script)
    got = _collect(
        pool,
        engine,
        [_item("a"), _item("b")],
        more=lambda count, attempt: [_item("a"), _item("b")],
        dynamic_sampling=True,
        max_generation_batches=3,
    )
    assert len(engine.calls) == 3 and got.stats.generation_batches == 3
    # Nothing carried signal: the last batch is kept unfiltered, with zero advantages (zero gradient).
    assert got.batch.num_rows == 2 * N and torch.all(got.batch.advantages == 0)


# Batch 0 gives rank 0 two groups with signal and rank 1 none; the refill then has more than is needed.
GLOBAL_SCRIPT = {
    (0, "a"): MIXED,
    (0, "b"): MIXED,
    (0, "c"): ALL_WRONG,
    (0, "d"): ALL_WRONG,
    (1, "e"): ALL_RIGHT,
    (1, "f"): ["no", "yes", "no", "no"],
    (1, "g"): ["yes", "yes", "no", "yes"],
    (1, "h"): MIXED,
}


def collect_share(rank: int, world: int) -> tuple[list[str], list[str], list[float]]:
    """Rank ``rank`` of ``world`` collects its share of the global batch a b c d (refill e f g h)."""
    first, refill = "abcd", "efgh"
    share = len(first) // world
    with VerifierPool() as pool:
        got = _collect(
            pool,
            ScriptedEngine(GLOBAL_SCRIPT),
            [_item(x) for x in first[rank * share : (rank + 1) * share]],
            more=lambda count, attempt: [_item(x) for x in refill[rank * count : (rank + 1) * count]],
            dynamic_sampling=True,
            max_generation_batches=5,
        )
    return [item["id"] for item in got.items], got.texts, got.batch.advantages.tolist()


@pytest.mark.slow
def test_dynamic_sampling_filters_the_global_batch(tmp_path):
    """Two gloo ranks keep, between them, exactly the groups one process keeps, in the same order and dealt
    back evenly; filtering each rank on its own would keep a b g h (rank 1 refilling on its own)."""
    from tests.distributed import run_on_ranks

    one_ids, one_texts, one_advantages = collect_share(0, 1)
    assert one_ids == ["a", "b", "f", "g"]
    ranks = run_on_ranks(collect_share, tmp_path)
    assert [ranks[r][0] for r in (0, 1)] == [["a", "b"], ["f", "g"]]
    assert ranks[0][1] + ranks[1][1] == one_texts
    assert ranks[0][2] + ranks[1][2] == pytest.approx(one_advantages)


def collect_one_survivor(rank: int, world: int) -> tuple[list[str], int, int, list[str]]:
    """Rank ``rank`` of ``world`` collects its share of a b c d, of which only a has rewards that differ: the kept
    groups' ids, the batch's rows, its rows with a token to train on, and the responses it reports."""
    script = {(0, "a"): MIXED, (0, "b"): ALL_WRONG, (0, "c"): ALL_WRONG, (0, "d"): ALL_RIGHT}
    share = 4 // world
    with VerifierPool() as pool:
        got = _collect(
            pool,
            ScriptedEngine(script),
            [_item(x) for x in "abcd"[rank * share : (rank + 1) * share]],
            dynamic_sampling=True,
            max_generation_batches=1,
        )
    batch = got.batch
    return [item["id"] for item in got.items], batch.num_rows, int(batch.response_mask.any(-1).sum()), got.texts


@pytest.mark.slow
def test_a_rank_dealt_no_kept_group_holds_rows_without_a_token_to_train_on(tmp_path):
    """One kept group, two ranks: rank 0 trains on it, rank 1 on a stand-in (its own rows, for the update's
    collectives) that puts no token in the loss, its token-mean or any metric, and reports no group: between them
    the ranks hold what one process holds. Before, rank 1 trained on its rows at zero advantage, and their tokens
    diluted the step's token-mean (and its metrics) as one process's never are."""
    from tests.distributed import run_on_ranks

    one = collect_one_survivor(0, 1)
    assert one[0] == ["a"] and one[1] == one[2] == N
    ranks = run_on_ranks(collect_one_survivor, tmp_path)
    assert ranks[0] == one
    assert ranks[1] == ([], 2 * N, 0, [])


def test_seeds_follow_the_prompt_and_the_generation_batch_not_the_position(pool):
    engine = ScriptedEngine({(0, "a"): MIXED, (0, "b"): MIXED, (1, "b"): MIXED, (1, "a"): MIXED})
    _collect(pool, engine, [_item("a"), _item("b")], dynamic_sampling=False)
    _collect(pool, engine, [_item("b"), _item("a")], dynamic_sampling=False)
    (_, first), (_, swapped) = engine.calls
    assert first == swapped[::-1] and first[0] != first[1]


def test_overlong_shaping_changes_rewards_not_correctness(pool):
    long_yes = "yes" + " " * 7  # 10 tokens > max_new_tokens - buffer
    engine = ScriptedEngine({(0, "a"): [long_yes, "yes", "no", "no"]})
    got = _collect(pool, engine, [_item("a")], dynamic_sampling=False, overlong_buffer=4)
    assert got.correct.tolist() == [[1.0, 1.0, 0.0, 0.0]]
    assert got.batch.rewards.tolist() == [0.0, 1.0, 0.0, 0.0]  # 10 tokens: past the limit of 8, penalty -1
    assert got.truncated.tolist() == [True, False, False, False]


def test_official_semantics_filter_on_accuracy_not_on_the_shaped_reward(pool):
    """A group all correct whose overlong penalty spreads its rewards: the project keeps it (its advantages are
    not zero), the official semantics drop it (its accuracy does not vary) and refill."""
    long_yes = "yes" + " " * 7  # past max_new_tokens - buffer: penalised
    script = {(0, "a"): [long_yes, "yes", "yes", "yes"], (1, "b"): MIXED}
    more = lambda count, attempt: [_item("b")]  # noqa: E731
    common = dict(dynamic_sampling=True, overlong_buffer=4, max_generation_batches=3)
    project = _collect(pool, ScriptedEngine(script), [_item("a")], more=more, **common)
    official = _collect(pool, ScriptedEngine(script), [_item("a")], more=more, **OFFICIAL, **common)
    assert [i["id"] for i in project.items] == ["a"] and project.stats.generation_batches == 1
    assert [i["id"] for i in official.items] == ["b"] and official.stats.generation_batches == 2


def test_generation_batch_multiplier_generates_more_per_round_and_keeps_the_step_size(pool):
    script = {(0, x): s for x, s in zip("abcd", (ALL_RIGHT, MIXED, MIXED, MIXED))}
    engine, asked = ScriptedEngine(script), []

    def more(count, attempt):
        asked.append((count, attempt))
        return [_item(x) for x in "cdef"[:count]]

    got = _collect(
        pool, engine, [_item("a"), _item("b")], more=more, dynamic_sampling=True, generation_batch_multiplier=2
    )
    # One round of 2 x 2 prompts (the step's own, then two drawn): a has no signal, b and c fill the step.
    assert asked == [(2, 0)] and [len(prompts) for prompts, _ in engine.calls] == [4]
    assert [i["id"] for i in got.items] == ["b", "c"]
    # A drawn prompt is seeded apart from the step's own prompt of the same id.
    repeat = ScriptedEngine({(0, "a"): MIXED})
    _collect(
        pool, repeat, [_item("a")], more=lambda c, a: [_item("a")], dynamic_sampling=True, generation_batch_multiplier=2
    )
    seeds = repeat.calls[0][1]
    assert seeds[:N] != seeds[N:]


def test_official_semantics_stop_when_the_budget_runs_out(pool):
    script = {(b, x): ALL_WRONG for b in range(2) for x in "ab"}
    more = lambda count, attempt: [_item("a"), _item("b")]  # noqa: E731
    kwargs = dict(dynamic_sampling=True, max_generation_batches=2)
    with pytest.raises(
        RuntimeError, match=r"kept 0 of the step's 2 groups after 2 generation batches.*max_generation_batches=2"
    ):
        _collect(pool, ScriptedEngine(script), [_item("a"), _item("b")], more=more, **OFFICIAL, **kwargs)
    # The project's semantics train on what they kept (here: the last batch, at zero advantage).
    assert _collect(pool, ScriptedEngine(script), [_item("a"), _item("b")], more=more, **kwargs).batch.num_rows == 2 * N
