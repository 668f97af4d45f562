"""Record loading: JSONL / JSON / Parquet / datasets directories, and the errors bad data must raise."""

from __future__ import annotations

import json
import re

import pytest

from stare_lightning.data import DataError, PromptRecord, load_records

ROWS = [
    {"id": "a", "prompt": "What is 2+2?", "answer": "4", "verifier": "numeric"},
    {"id": "b", "messages": [{"role": "user", "content": "Name a prime."}], "answer": "2", "verifier": "exact"},
    {"prompt": "Compute 1/2.", "answer": 0.5, "verifier": "math", "metadata": {"level": 1}, "source": "x"},
    {
        "id": 7,
        "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "3 5 7 -> 22:"}],
        "answer": "22",
        "verifier": "countdown",
        "metadata": {"numbers": [3, 5, 7], "target": 22},
    },
]


def write_jsonl(path, rows, raw_lines=()):
    lines = [json.dumps(r) for r in rows] + list(raw_lines)
    path.write_text("\n".join(lines) + "\n")
    return path


def write_parquet(path, rows):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def check_rows(records, label):
    assert [type(r) for r in records] == [PromptRecord] * 4
    a, b, c, d = records
    assert (a.id, a.prompt, a.messages, a.answer, a.verifier) == ("a", "What is 2+2?", None, "4", "numeric")
    assert b.prompt is None and b.messages == [{"role": "user", "content": "Name a prime."}]
    assert c.answer == "0.5" and c.metadata["level"] == 1 and c.metadata["source"] == "x"  # extra keys -> metadata
    assert c.id.startswith(label + ":")  # automatic id: file name and position
    assert d.id == "7" and d.prompt is None and d.messages[0]["role"] == "system"  # a list prompt is a chat
    assert d.metadata["numbers"] == [3, 5, 7]


def test_jsonl(tmp_path):
    records = load_records(write_jsonl(tmp_path / "data.jsonl", ROWS[:2], raw_lines=["", "   "]))
    assert len(records) == 2  # blank lines are skipped
    records = load_records(write_jsonl(tmp_path / "all.jsonl", ROWS))
    check_rows(records, "all.jsonl")
    assert records[2].id == "all.jsonl:3"  # 1-based line number


def test_json(tmp_path):
    path = tmp_path / "all.json"
    path.write_text(json.dumps(ROWS, indent=2))
    records = load_records(path)
    check_rows(records, "all.json")
    assert records[2].id == "all.json:2"  # 0-based item index


def test_parquet(tmp_path):
    rows = [
        {
            "id": "a",
            "prompt": "What is 2+2?",
            "messages": None,
            "answer": "4",
            "verifier": "numeric",
            "metadata": {"numbers": None, "target": None},
        },
        {
            "id": "b",
            "prompt": None,
            "messages": [{"role": "user", "content": "Name a prime."}],
            "answer": "2",
            "verifier": "exact",
            "metadata": {"numbers": None, "target": None},
        },
        {
            "id": None,
            "prompt": "3 5 7 -> 22:",
            "messages": None,
            "answer": "22",
            "verifier": "countdown",
            "metadata": {"numbers": [3, 5, 7], "target": 22},
        },
    ]
    records = load_records(write_parquet(tmp_path / "all.parquet", rows))
    assert [r.id for r in records] == ["a", "b", "all.parquet:2"]  # 0-based row index
    assert records[0].prompt == "What is 2+2?" and records[0].messages is None
    assert records[1].prompt is None and records[1].messages == [{"role": "user", "content": "Name a prime."}]
    assert records[2].metadata == {"numbers": [3, 5, 7], "target": 22} and records[2].verifier == "countdown"


@pytest.mark.needs("datasets")
def test_datasets_directory(tmp_path):
    import datasets

    rows = [{"question": "1+1?", "sol": {"value": "2"}}, {"question": "2+3?", "sol": {"value": "5"}}]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "ds"))
    ds = datasets.load_from_disk(str(tmp_path / "ds"))
    columns = {"prompt": "question", "answer": "sol.value"}
    records = load_records(tmp_path / "ds", default_verifier="numeric", columns=columns)
    assert [(r.prompt, r.answer, r.verifier) for r in records] == [("1+1?", "2", "numeric"), ("2+3?", "5", "numeric")]
    assert "question" not in records[0].metadata  # mapped columns do not leak into metadata
    datasets.DatasetDict({"test": ds, "validation": ds.select([0])}).save_to_disk(str(tmp_path / "dd"))
    kwargs = dict(default_verifier="numeric", columns={"prompt": "question", "answer": "sol.value"})
    with pytest.raises(DataError, match=r"no split 'train'; available splits: \['test', 'validation'\]"):
        load_records(tmp_path / "dd", split="train", **kwargs)
    with pytest.raises(DataError, match="choose one"):
        load_records(tmp_path / "dd", **kwargs)
    assert len(load_records(tmp_path / "dd", split="validation", **kwargs)) == 1


@pytest.mark.needs("datasets")
def test_hub_id_offline_gives_a_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(DataError) as info:
        load_records("someone/some-dataset-that-is-not-here", default_verifier="math")
    assert "Hugging Face hub" in str(info.value) and "save_to_disk" in str(info.value)


def test_missing_file(tmp_path):
    with pytest.raises(DataError, match="data file not found"):
        load_records(tmp_path / "nope.jsonl")


# -- errors that name file, line and key -------------------------------------------------------------


def test_malformed_jsonl_line_names_file_and_line(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", ROWS[:2], raw_lines=['{"prompt": "x", "answer": '])
    with pytest.raises(DataError) as info:
        load_records(path)
    assert str(info.value).startswith(f"{path}, line 3: malformed JSON")


def test_malformed_json_names_line_and_suggests_jsonl(tmp_path):
    path = tmp_path / "lines.json"
    write_jsonl(path, ROWS[:2])
    with pytest.raises(DataError, match=r"lines\.json, line 2, column 1: malformed JSON .*\.jsonl"):
        load_records(path)


def test_missing_answer_names_file_line_and_key(tmp_path):
    rows = [ROWS[0], {"id": "x", "prompt": "no answer here", "verifier": "math"}]
    path = write_jsonl(tmp_path / "noanswer.jsonl", rows)
    with pytest.raises(DataError) as info:
        load_records(path)
    message = str(info.value)
    assert message.startswith(f"{path}, line 2:") and "missing required key 'answer'" in message


def test_missing_answer_in_json_and_parquet_names_item_and_row(tmp_path):
    rows = [{"prompt": "p1", "answer": "1"}, {"prompt": "p2", "answer": None}]
    path = tmp_path / "rows.json"
    path.write_text(json.dumps(rows))
    with pytest.raises(DataError, match=r"rows\.json, item 1: missing required key 'answer'"):
        load_records(path, default_verifier="exact")
    with pytest.raises(DataError, match=r"rows\.parquet, row 1: missing required key 'answer'"):
        load_records(write_parquet(tmp_path / "rows.parquet", rows), default_verifier="exact")


@pytest.mark.parametrize(
    "row, pattern",
    [
        ({"answer": "1"}, "missing required key 'prompt'"),
        ({"prompt": "   ", "answer": "1"}, "'prompt' must be a non-empty string"),
        (
            {"prompt": "p", "messages": [{"role": "user", "content": "p"}], "answer": "1"},
            "both 'prompt' and 'messages'",
        ),
        ({"messages": [{"role": "user"}], "answer": "1"}, r"messages\[0\] needs a string 'content'"),
        ({"prompt": "p", "answer": ""}, "'answer' is empty"),
        ({"prompt": "p", "answer": ["1", "2"]}, "'answer' must be a string or a number"),
        ({"prompt": "p", "answer": "1", "metadata": "m"}, "'metadata' must be an object"),
        ([1, 2], "expected an object"),
    ],
)
def test_bad_rows(tmp_path, row, pattern):
    path = write_jsonl(tmp_path / "r.jsonl", [ROWS[0], row])
    with pytest.raises(DataError, match=r"r\.jsonl, line 2: .*" + pattern):
        load_records(path, default_verifier="exact")


def test_unknown_verifier_lists_the_known_ones(tmp_path):
    path = write_jsonl(tmp_path / "v.jsonl", [ROWS[0], {"prompt": "p", "answer": "1", "verifier": "mathh"}])
    with pytest.raises(DataError) as info:
        load_records(path)
    message = str(info.value)
    assert "v.jsonl, line 2: key 'verifier'" in message and "'mathh'" in message
    assert "countdown, exact, last_number, math, numeric" in message


def test_missing_verifier_without_default(tmp_path):
    path = write_jsonl(tmp_path / "v.jsonl", [{"prompt": "p", "answer": "1"}])
    with pytest.raises(DataError, match="line 1: missing key 'verifier' and no default verifier"):
        load_records(path)
    assert load_records(path, default_verifier="exact")[0].verifier == "exact"


def test_user_verifiers_need_the_config(tmp_path, monkeypatch):
    (tmp_path / "rec_user_mod.py").write_text("def score(response, answer, metadata):\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    tmp_path.chmod(0o755)  # the verifier worker runs as a uid of its own
    path = write_jsonl(tmp_path / "u.jsonl", [{"prompt": "p", "answer": "1", "verifier": "rec_user_mod:score"}])
    with pytest.raises(DataError, match="user function that the config does not name"):
        load_records(path)
    assert load_records(path, user_verifiers=["rec_user_mod:score"])[0].verifier == "rec_user_mod:score"
    assert load_records(path, default_verifier="rec_user_mod:score")[0].verifier == "rec_user_mod:score"


def test_records_the_verifier_cannot_score_are_refused(tmp_path):
    path = write_jsonl(tmp_path / "n.jsonl", [{"prompt": "p", "answer": "four", "verifier": "numeric"}])
    with pytest.raises(DataError, match=r"n\.jsonl, line 1: .*numeric verifier needs a number"):
        load_records(path)
    path = write_jsonl(tmp_path / "c.jsonl", [{"prompt": "p", "answer": "22", "verifier": "countdown"}])
    with pytest.raises(DataError, match=r"c\.jsonl, line 1: .*metadata key 'numbers'"):
        load_records(path)


def test_duplicate_ids(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [ROWS[0], dict(ROWS[0])])
    with pytest.raises(DataError, match=r"line 2: duplicate id 'a' \(first seen at line 1\)"):
        load_records(path)


def test_prompt_record_checks_itself():
    with pytest.raises(ValueError, match="exactly one of 'prompt' or 'messages'"):
        PromptRecord("x", None, None, "1", "exact", {})
    with pytest.raises(ValueError, match="exactly one"):
        PromptRecord("x", "p", [{"role": "user", "content": "p"}], "1", "exact", {})


def verl_rows():
    """Rows in exactly the layout of verl's RL parquet files (and the STARE reference code's)."""
    return [
        {
            "data_source": source,
            "prompt": [{"role": "user", "content": f"What is {a}+{b}? Put the answer in \\boxed{{}}."}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(a + b)},
            "extra_info": {"split": "test", "index": i},
        }
        for i, (source, a, b) in enumerate([("aime24", 1, 2), ("aime24", 3, 4), ("amc23", 5, 6)])
    ]


def test_verl_parquet_is_read_as_it_is(tmp_path):
    path = write_parquet(tmp_path / "verl.parquet", verl_rows())
    records = load_records(path, default_verifier="math")
    assert [r.answer for r in records] == ["3", "7", "11"]
    assert records[0].prompt is None and records[0].messages[0]["content"].startswith("What is 1+2?")
    assert [r.metadata["data_source"] for r in records] == ["aime24", "aime24", "amc23"]
    assert records[2].metadata["extra_info"] == {"split": "test", "index": 2}
    # The explicit mapping of the same layout gives the same records: the mapped `prompt` column is read
    # only as `messages`, never also as the schema's `prompt`.
    mapped = load_records(
        path, default_verifier="math", columns={"messages": "prompt", "answer": "reward_model.ground_truth"}
    )
    assert mapped == records


def test_verl_parquet_names_the_benchmarks_of_a_val_file(tmp_path):
    from stare_lightning.data.benchmarks import benchmark_names, with_benchmark

    path = write_parquet(tmp_path / "mixed.parquet", verl_rows())
    records = with_benchmark(load_records(path, default_verifier="math"), "mixed")
    assert benchmark_names(records) == ["aime24", "amc23"]


def test_columns_compose_from_a_plain_override(tmp_path):
    from stare_lightning.cli import compose
    from stare_lightning.run_config import to_run_config

    path = write_parquet(tmp_path / "verl.parquet", verl_rows())
    mapping = "data.columns={messages: prompt, answer: reward_model.ground_truth}"
    cfg = compose(["data=files", f"data.train_files=[{path}]", mapping])
    columns = to_run_config(cfg).data.columns
    assert [len(load_records(path, default_verifier="math", columns=columns))] == [3]
    assert {k: v for k, v in columns.items() if v} == {"messages": "prompt", "answer": "reward_model.ground_truth"}


@pytest.mark.parametrize("suffix", ["jsonl", "json"])
@pytest.mark.parametrize("depth", [40, 100_000])  # past the limit, and past the JSON parser's own recursion limit
def test_deeply_nested_records_give_the_one_line_data_error(tmp_path, suffix, depth):
    row = '{"prompt": "p", "answer": "1", "verifier": "exact", "metadata": ' + "[" * depth + "]" * depth + "}"
    path = tmp_path / f"deep.{suffix}"
    path.write_text(row + "\n" if suffix == "jsonl" else f"[{row}]")
    where = "line 1" if suffix == "jsonl" else ("item 0" if depth == 40 else "")
    with pytest.raises(DataError, match=rf"deep\.{suffix}(, {where})?: JSON nested more than 32 levels deep"):
        load_records(path)


def test_a_user_verifier_must_be_a_function_defined_where_it_is_named(tmp_path, monkeypatch):
    """`module:attr` resolving to a re-export (os.system reached through a module's `os`) is refused, as is a
    builtin, a class or a private name; a function of the named module is accepted."""
    from stare_lightning.rewards.registry import get_verifier

    (tmp_path / "reexport_mod.py").write_text(
        "import os\nfrom json import dumps\n\n"
        "def _hidden(r, a, m):\n    return 1.0\n\n"
        "class Holder:\n    @staticmethod\n    def check(r, a, m):\n        return 1.0\n\n"
        "def score(r, a, m):\n    return 1.0\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    cases = {
        "stare_lightning.rewards.pool:os.system": "is a builtin_function_or_method, not a Python function",
        "reexport_mod:os.path.join": "is posixpath:join, defined elsewhere",
        "reexport_mod:dumps": "is json:dumps, defined elsewhere",
        "reexport_mod:_hidden": "private names",
        "reexport_mod:Holder": "is a type, not a Python function",
    }
    for name, reason in cases.items():
        with pytest.raises(ValueError, match=re.escape(reason)):
            get_verifier(name)
    assert get_verifier("reexport_mod:score")("x", "1", {}) == 1.0
    assert get_verifier("reexport_mod:Holder.check")("x", "1", {}) == 1.0
