"""``data=reasoning_gym``: records, splits, config errors, the ``reasoning_gym`` verifier (in and out of the pool)."""

from __future__ import annotations

import json
import textwrap
import time
from collections import Counter

import pytest

from tests.needs import require

require("reasoning_gym")

import reasoning_gym  # noqa: E402

from stare_lightning.data.config import DataConfig  # noqa: E402
from stare_lightning.data.records import load_records  # noqa: E402
from stare_lightning.data.tasks import build_records, sft_examples  # noqa: E402
from stare_lightning.data.tasks.reasoning_gym import COMPACT_GENERATORS, generator_names  # noqa: E402
from stare_lightning.rewards import VerifierPool, get_verifier  # noqa: E402
from stare_lightning.rewards.extract import final_answer  # noqa: E402

SMALL = {"min_terms": 2, "max_terms": 2, "max_digits": 1}  # chain_sum: 200 distinct questions


def gym(task, split, size, val_size=16, style="plain", seed=7, **kwargs):
    return build_records(task, split, size, source="reasoning_gym", style=style, seed=seed, val_size=val_size, **kwargs)


def original_entry(record):
    """The entry as reasoning-gym itself generates it, and the generator that made it."""
    info = record.metadata["reasoning_gym"]
    dataset = reasoning_gym.create_dataset(info["generator"], seed=info["seed"], size=1, **info["config"])
    return dataset, dataset[info["index"]]


# ---------------------------------------------------------------------------------------------- records


def test_records_are_deterministic_and_the_splits_disjoint():
    val = gym("chain_sum", "val", 0, val_size=48, **SMALL)
    train = gym("chain_sum", "train", 400, val_size=48, **SMALL)
    assert [(r.id, r.prompt, r.answer, r.metadata) for r in val] == [
        (r.id, r.prompt, r.answer, r.metadata) for r in gym("chain_sum", "val", 0, val_size=48, **SMALL)
    ]
    assert [r.metadata for r in train] == [r.metadata for r in gym("chain_sum", "train", 400, val_size=48, **SMALL)]
    assert len(val) == 48 and len(train) == 400
    val_prompts = {r.prompt for r in val}
    assert len(val_prompts) == 48  # validation questions are distinct
    assert not val_prompts & {r.prompt for r in train}  # disjoint by content ...
    last_val = max(r.metadata["reasoning_gym"]["index"] for r in val)
    assert min(r.metadata["reasoning_gym"]["index"] for r in train) > last_val  # ... and by index
    assert len({r.id for r in val + train}) == 448
    assert gym("chain_sum", "val", 0, val_size=48, seed=8, **SMALL)[0].metadata != val[0].metadata


def test_records_carry_the_entry_and_feed_the_cold_start():
    plain = gym("leg_counting", "train", 4)
    dataset, entry = original_entry(plain[0])
    record = plain[0]
    assert record.prompt == entry["question"] and record.answer == entry["answer"]
    assert record.verifier == "reasoning_gym" and record.metadata["data_source"] == "leg_counting"
    json.dumps([r.metadata for r in plain], allow_nan=False)
    assert sft_examples(plain) == [(r.prompt, r.answer) for r in plain]
    instruct = gym("leg_counting", "train", 4, style="instruct")
    assert instruct[0].prompt is None and instruct[0].messages[0]["content"].startswith(entry["question"])
    assert "\\boxed{}" in instruct[0].messages[0]["content"]
    with pytest.raises(ValueError, match="plain-style"):
        sft_examples(instruct)
    compact = gym("chain_sum", "train", 4, compact=True, **SMALL)
    expressions = [original_entry(r)[1]["metadata"]["expression"] for r in compact]
    assert [r.prompt for r in compact] == [e.replace(" ", "") + "=" for e in expressions]


@pytest.mark.parametrize("name", ["knights_knaves", "advanced_geometry", "complex_arithmetic", "graph_color"])
def test_non_json_metadata_is_converted_and_still_scores(name):
    """numpy strings, tuples, int dict keys: converted to JSON, and the generator's scorer still agrees."""
    records = gym(name, "train", 3, val_size=2)
    verify = get_verifier("reasoning_gym")
    for record in records:
        json.dumps(record.metadata, allow_nan=False)
        dataset, entry = original_entry(record)
        oracle = entry["answer"]
        if oracle is None:  # graph_color: no single answer; its metadata holds one valid colouring
            oracle = json.dumps(entry["metadata"]["possible_answer"])
        assert dataset.score_answer(oracle, entry) == 1.0
        assert verify(f"\\boxed{{{oracle}}}", record.answer, record.metadata) == 1.0
        assert verify("nonsense", record.answer, record.metadata) == dataset.score_answer("nonsense", entry)


def test_a_mixture_draws_each_member_in_proportion():
    kwargs = {"datasets": {"chain_sum": 3, "spell_backward": {"weight": 1, "config": {"min_word_len": 3}}}}
    train = gym("mixture", "train", 2000, **kwargs)
    counts = Counter(r.metadata["data_source"] for r in train)
    assert set(counts) == {"chain_sum", "spell_backward"}
    assert abs(counts["chain_sum"] / 2000 - 0.75) < 0.04
    verify = get_verifier("reasoning_gym")
    firsts = {r.metadata["data_source"]: r for r in reversed(train)}
    for record in firsts.values():
        assert verify(record.answer, record.answer, record.metadata) == 1.0
    assert firsts["spell_backward"].metadata["reasoning_gym"]["config"] == {"min_word_len": 3}


# ----------------------------------------------------------------------------------------------- config


def data_config(**overrides):
    return DataConfig(**{"source": "reasoning_gym", "task": "chain_sum", **overrides})


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"task": "chain_sums"}, r"data.task='chain_sums' is not a reasoning-gym generator; did you mean chain_sum"),
        ({"task": "nope"}, r"all of them: python -c .*generator_names"),
        ({"task": None}, r"data.source=reasoning_gym needs data.task"),
        ({"source": "gym"}, r"data.source='gym' is not allowed: choose one of \['builtin', 'reasoning_gym'\]"),
        ({"source": "builtin"}, r"data.task='chain_sum' is not allowed.*use data=reasoning_gym"),
        (
            {"task_kwargs": {"max_term": 3}},
            r"data.task_kwargs: unknown keys \['max_term'\] for reasoning-gym.*min_terms",
        ),
        ({"task_kwargs": {"seed": 3}}, r"data.task_kwargs: \['seed'\] cannot be set.*data.seed"),
        ({"task_kwargs": {"min_terms": 0}}, r"data.task_kwargs: reasoning-gym generator 'chain_sum' refuses.*positive"),
        ({"task_kwargs": {"compact": "yes"}}, r"data.task_kwargs.compact='yes' is not allowed: must be true or false"),
        ({"task": "leg_counting", "task_kwargs": {"compact": True}}, r"compact=true needs generators.*leg_counting"),
        ({"task": "composite"}, r"write data.task=mixture"),
        ({"task": "mixture"}, r"data.task_kwargs.datasets=None is not allowed"),
        ({"task": "mixture", "task_kwargs": {"datasets": {"chain_sum": 0}}}, r"datasets.chain_sum=0 is out of range"),
        (
            {"task": "mixture", "task_kwargs": {"datasets": {"chain_sum": {"weight": 1, "max_terms": 3}}}},
            r"datasets.chain_sum: unknown keys \['max_terms'\].*settings go in config",
        ),
        (
            {"task": "mixture", "task_kwargs": {"datasets": {"chain_sum": {"config": {"max_digits": 0}}}}},
            r"datasets.chain_sum.config: reasoning-gym generator 'chain_sum' refuses",
        ),
        ({"task": "mixture", "task_kwargs": {"datasets": {"chain_sum": 1}, "x": 1}}, r"unknown keys \['x'\]"),
        ({"train_files": ["a.jsonl"]}, r"data.train_files are both set"),
    ],
)
def test_config_errors_name_the_key(overrides, message):
    with pytest.raises(ValueError, match=message):
        data_config(**overrides)


def test_the_default_data_config_is_untouched():
    cfg = DataConfig()
    assert (cfg.source, cfg.task, cfg.task_kwargs) == ("builtin", "countdown", {})
    assert set(COMPACT_GENERATORS) <= set(generator_names()) and "composite" not in generator_names()


# --------------------------------------------------------------------------------------------- verifier

GENERATORS = {
    "chain_sum": {"max_terms": 3, "max_digits": 2},
    "basic_arithmetic": {"max_terms": 3, "max_digits": 2},
    "leg_counting": {},
    "spell_backward": {},
}


def responses_and_texts(answer: str) -> list[tuple[str, str]]:
    """(response, the text reasoning-gym's scorer should see) for correct, wrong and formatted answers."""
    return [
        (answer, answer),
        ("17x", "17x"),
        (f"Let me think.\nThe result is \\boxed{{{answer}}}.", answer),
        (f"First \\boxed{{1}}, then \\boxed{{{answer}}}", answer),
        (f"Working...\nAnswer: {answer}", answer),
        (f"Working...\nFinal answer: {answer}0", f"{answer}0"),
        (f"{answer} is it", f"{answer} is it"),
        ("", ""),
    ]


def scoring_cases():
    cases = []
    for name, config in GENERATORS.items():
        for record in gym(name, "val", 0, val_size=4, style="instruct", **config):
            for response, text in responses_and_texts(record.answer):
                cases.append((record, response, text))
    return cases


def test_the_verifier_agrees_with_score_answer_in_and_out_of_the_pool():
    cases = scoring_cases()
    verify = get_verifier("reasoning_gym")
    expected = []
    for record, response, text in cases:
        assert final_answer(response) in (None, text)
        dataset, entry = original_entry(record)
        expected.append(dataset.score_answer(text, entry))
        assert verify(response, record.answer, record.metadata) == expected[-1], (record.id, response)
    assert {1.0, 0.0} <= set(expected)
    with VerifierPool(timeout_s=30.0) as pool:
        result = pool.score([("reasoning_gym", resp, rec.answer, rec.metadata) for rec, resp, _ in cases])
    assert result.scores == expected and result.timeouts == result.errors == 0


SLOW_MODULE = """
import time
from dataclasses import dataclass
from typing import Optional

from reasoning_gym.dataset import ProceduralDataset
from reasoning_gym.factory import DATASETS, register_dataset

from stare_lightning.rewards.reasoning_gym import verify_reasoning_gym


@dataclass
class SlowConfig:
    seed: Optional[int] = None
    size: int = 10


class SlowDataset(ProceduralDataset):
    def __init__(self, config):
        super().__init__(config=config, seed=config.seed, size=config.size)

    def __getitem__(self, idx):
        return {"question": "q", "answer": "a", "metadata": {"source_dataset": "slow_test"}}

    def score_answer(self, answer, entry):
        time.sleep(3600)  # far beyond any bound below: only a kill ends it
        return 1.0


if "slow_test" not in DATASETS:
    register_dataset("slow_test", SlowDataset, SlowConfig)


def verify(response, answer, metadata):
    return verify_reasoning_gym(response, answer, metadata)
"""


def test_a_slow_scorer_times_out_cleanly_in_the_pool(tmp_path, monkeypatch):
    (tmp_path / "slow_rg_scorer.py").write_text(textwrap.dedent(SLOW_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))  # the spawned worker inherits sys.path
    tmp_path.chmod(0o755)  # the verifier worker runs as a uid of its own
    good = gym("chain_sum", "val", 0, val_size=1, **SMALL)[0]
    slow = {"reasoning_gym": {"generator": "slow_test", "config": {}, "seed": 0, "answer": "a", "metadata": {}}}
    items = [
        ("reasoning_gym", good.answer, good.answer, good.metadata),
        ("slow_rg_scorer:verify", "a", "a", slow),
        ("reasoning_gym", good.answer, good.answer, good.metadata),
    ]
    # Each item gets the per-item limit (a good one takes milliseconds); each worker start and its imports get the
    # start-up limit, charged to no item; SLACK covers the kill, the reaping and the parent's polling.
    limit, startup, slack = 5.0, 60.0, 10.0
    with VerifierPool(timeout_s=limit, startup_timeout_s=startup) as pool:
        started = time.monotonic()
        result = pool.score(items)
        took = time.monotonic() - started
        assert result.scores == [1.0, 0.0, 1.0] and result.timeouts == 1 and result.errors == 0
        assert pool.starts == 2  # the stuck worker was killed and a fresh one finished the batch
    # The slow item had its whole limit before the kill, and the call ended within what the limits allow for two
    # worker starts and three items: long before the scorer's hour, so the worker was killed, not waited for.
    assert limit <= took <= 2 * startup + len(items) * limit + slack, took


def test_records_survive_a_jsonl_file_and_are_checked_on_load(tmp_path):
    records = gym("basic_arithmetic", "val", 0, val_size=6, style="instruct", max_terms=3, max_digits=2)
    path = tmp_path / "rg.jsonl"
    keys = ("id", "messages", "answer", "verifier", "metadata")
    rows = [{key: getattr(r, key) for key in keys} for r in records]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    loaded = load_records(path)
    verify = get_verifier("reasoning_gym")
    assert all(verify(f"\\boxed{{{r.answer}}}", r.answer, r.metadata) == 1.0 for r in loaded)
    bad = {**rows[0], "metadata": {"reasoning_gym": {"generator": "chain_sum"}}}
    path.write_text(json.dumps(bad) + "\n")
    with pytest.raises(ValueError, match="'config' must be an object"):
        load_records(path)


# ------------------------------------------------------------------------------------------------- fit


@pytest.mark.slow
def test_a_short_fit_runs_offline_on_a_reasoning_gym_task(tmp_path, model_cache):
    from stare_lightning import train
    from stare_lightning.cli import compose, prepare_config

    overrides = [
        f"output_dir={tmp_path}",
        "debug=fast",
        "rollout=hf",
        "data=reasoning_gym",
        "data.task=chain_sum",
        "+data.task_kwargs={max_terms: 2, max_digits: 1, compact: true}",
        "model.cold_start.steps=20",
        "trainer.max_steps=2",
        "validation.before_fit=false",
    ]
    cfg = prepare_config(compose(overrides))[1]
    assert cfg.data.source == "reasoning_gym"
    trainer = train.fit(cfg)
    assert trainer.global_step == 2
    assert (tmp_path / "logs" / "metrics.csv").is_file()
