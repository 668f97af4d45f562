"""Data recipes: small files with the public releases' real column names -> prompt records, through
``prepare`` and through ``python -m stare_lightning prepare``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from stare_lightning import cli
from stare_lightning.__main__ import main as cli_main
from stare_lightning.data import DataError, load_records
from stare_lightning.data.recipes import PAPER_SUFFIX, RECIPES, describe_recipes, prepare, run_recipe
from stare_lightning.rewards import get_verifier

DAPO_HEAD = (
    "Solve the following math problem step by step. The last line of your response should be of the form "
    "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
)
DAPO_TAIL = '\n\nRemember to put your answer on its own line after "Answer:".'


def _dapo(problem, answer, index):
    return {
        "data_source": "math_dapo",
        "prompt": [{"content": DAPO_HEAD + problem + DAPO_TAIL, "role": "user"}],
        "ability": "MATH",
        "reward_model": {"ground_truth": answer, "style": "rule-lighteval/MATH_v2"},
        "extra_info": {"index": index},
    }


def _aime24(i, problem, answer, year=2024):
    url = f"https://artofproblemsolving.com/wiki/index.php/{year}_AIME_I_Problems/Problem_{i}"
    return {"id": 60 + i, "problem": problem, "solution": f"... so $\\boxed{{{answer}}}$.", "answer": answer}, url


def _olympiad(i, question, final_answer):
    return {
        "id": 1600 + i,
        "question": question,
        "solution": ["A long proof."],
        "final_answer": final_answer,
        "context": None,
        "is_multiple_answer": len(final_answer) > 1,
        "unit": None,
        "answer_type": "Numerical",
        "subfield": "Algebra",
        "subject": "Math",
        "language": "English",
    }


def _aime24_rows():
    rows = []
    for i, (problem, answer, year) in enumerate(
        [("Find $m+n$ for the walk.", "204", 2024), ("Last year's problem.", "7", 2023), ("Find $AP$.", "113", 2024)]
    ):
        row, url = _aime24(i, problem, answer, year)
        rows.append({**row, "url": url, "year": str(year)})
    return rows


# recipe -> (file name, rows as the release ships them, the expected (problem, answer) pairs, a required column)
CASES = {
    "dapo-math-17k": (
        "dapo-math-17k.parquet",
        [
            _dapo("Find $x$ if $2x = 68$.", "34", "9a9b6eb4-0001"),
            _dapo("How many primes are below $12$?", "5", "9a9b6eb4-0002"),
            _dapo("Find $x$ if $2x = 68$.", "34", "9a9b6eb4-0001"),  # the release repeats its problems
            _dapo("Solve $x + 4 = 1$.", "-3", "9a9b6eb4-0003"),
        ],
        [("Find $x$ if $2x = 68$.", "34"), ("How many primes are below $12$?", "5"), ("Solve $x + 4 = 1$.", "-3")],
        "reward_model.ground_truth",
    ),
    "aime24": (
        "train-00000-of-00001.parquet",
        _aime24_rows(),
        [("Find $m+n$ for the walk.", "204"), ("Find $AP$.", "113")],
        "answer",
    ),
    "aime25": (
        "test.jsonl",
        [
            {"problem": "Find the sum of all integer bases $b>9$.", "answer": "70", "id": "0"},
            {"problem": "Find the area of heptagon $AFNBCEM$.", "answer": "588", "id": "1"},
            {"problem": "Find the number of ordered pairs.", "answer": "117", "id": "2"},
        ],
        [
            ("Find the sum of all integer bases $b>9$.", "70"),
            ("Find the area of heptagon $AFNBCEM$.", "588"),
            ("Find the number of ordered pairs.", "117"),
        ],
        "problem",
    ),
    "amc23": (
        "train-00000-of-00001.parquet",
        [
            {"id": 0, "problem": "How many miles from City $A$?", "answer": 27.0, "url": "https://x/2023_AMC_12A/P1"},
            {"id": 1, "problem": "An older problem.", "answer": 5.0, "url": "https://x/2022_AMC_12A/P1"},
            {"id": 2, "problem": "What is $x+y$?", "answer": 36.0, "url": "https://x/2023_AMC_12A/P2"},
            {"id": 3, "problem": "What is the value of the sum?", "answer": 3159.0, "url": "https://x/2023_AMC_12A/P3"},
        ],
        [("How many miles from City $A$?", "27"), ("What is $x+y$?", "36"), ("What is the value of the sum?", "3159")],
        "answer",
    ),
    "math500": (
        "test.jsonl",
        [
            {
                "problem": "Convert the point $(0,3)$ to polar coordinates.",
                "solution": "So the answer is $\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}.$",
                "answer": "\\left( 3, \\frac{\\pi}{2} \\right)",
                "subject": "Precalculus",
                "level": 2,
                "unique_id": "test/precalculus/807.json",
            },
            {
                "problem": "Write the double sum in terms of $p$ and $q$.",
                "solution": "... $\\boxed{p - q}$.",
                "answer": "p - q",
                "subject": "Intermediate Algebra",
                "level": 5,
                "unique_id": "test/intermediate_algebra/1994.json",
            },
            {
                "problem": "What is $f(-2)$?",
                "solution": "... $\\boxed{\\frac{14}{3}}$.",
                "answer": "\\frac{14}{3}",
                "subject": "Algebra",
                "level": 3,
                "unique_id": "test/algebra/2584.json",
            },
        ],
        [
            ("Convert the point $(0,3)$ to polar coordinates.", "\\left( 3, \\frac{\\pi}{2} \\right)"),
            ("Write the double sum in terms of $p$ and $q$.", "p - q"),
            ("What is $f(-2)$?", "\\frac{14}{3}"),
        ],
        "problem",
    ),
    "minerva-math": (
        "test.jsonl",
        [
            {
                "idx": 0,
                "problem": "Find the image diameter.",
                "solution": "$s=\\boxed{1.6} \\mathrm{~cm}$",
                "type": "A",
            },
            {"idx": 1, "problem": "Compute the luminosity.", "solution": "L \\simeq \\boxed{4.5e33}", "type": "A"},
            {"idx": 2, "problem": "Find the resolution.", "solution": "$=\\boxed{0.49}$ arcsecs", "type": "A"},
        ],
        [("Find the image diameter.", "1.6"), ("Compute the luminosity.", "4.5e33"), ("Find the resolution.", "0.49")],
        "problem",
    ),
    "olympiadbench": (
        "test.jsonl",
        [
            _olympiad(6, "How many moves does Sergey need?", ["2"]),
            _olympiad(10, "Determine the largest real number $\\mu$.", ["$\\frac{1}{2 n+2}$"]),
            _olympiad(14, "Find the largest cardinality.", ["$2n-2$"]),
            _olympiad(15, "Find all $n$ and $k$.", ["$3$", "$5$"]),
        ],
        [
            ("How many moves does Sergey need?", "2"),
            ("Determine the largest real number $\\mu$.", "\\frac{1}{2 n+2}"),
            ("Find the largest cardinality.", "2n-2"),
            ("Find all $n$ and $k$.", "3, 5"),
        ],
        "final_answer",
    ),
    "gsm8k": (
        "test-00000-of-00001.parquet",
        [
            {"question": "Natalia sold clips to 48 friends.", "answer": "48/2 = <<48/2=24>>24\n#### 72"},
            {"question": "How much did he pay in total?", "answer": "1,000 dollars\n#### 1,000"},
            {"question": "How many eggs are left?", "answer": "16 - 3 - 4 = 9\n#### 9"},
        ],
        [
            ("Natalia sold clips to 48 friends.", "72"),
            ("How much did he pay in total?", "1000"),
            ("How many eggs are left?", "9"),
        ],
        "answer",
    ),
}


def write(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def drop(row: dict, column: str) -> dict:
    """``row`` without ``column`` (a dotted path drops a key of a nested object)."""
    top, _, inner = column.partition(".")
    row = dict(row)
    if inner:
        row[top] = {k: v for k, v in row[top].items() if k != inner}
    else:
        del row[top]
    return row


def check_math(record) -> None:
    verify = get_verifier("math")
    assert verify(f"Some reasoning.\n\nThe answer is $\\boxed{{{record.answer}}}$.", record.answer, {}) == 1.0
    assert verify("Some reasoning.\n\nThe answer is $\\boxed{999999}$.", record.answer, {}) == 0.0


def test_every_recipe_has_a_case():
    assert set(CASES) == set(RECIPES)


@pytest.mark.parametrize("name", list(CASES))
def test_recipe(name, tmp_path):
    file_name, rows, expected, _ = CASES[name]
    src = write(tmp_path / name / file_name, rows)
    out = prepare(name, src, tmp_path / "out" / f"{name}.jsonl", suffix="paper")
    records = load_records(out)
    assert [(r.messages[0]["content"], r.answer) for r in records] == [
        (f"{problem}\n\n{PAPER_SUFFIX}", answer) for problem, answer in expected
    ]
    assert all(len(r.messages) == 1 and r.messages[0]["role"] == "user" and r.prompt is None for r in records)
    assert len({r.id for r in records}) == len(records)
    assert {r.verifier for r in records} == {"math"} and {r.metadata["data_source"] for r in records} == {name}
    for record in records:
        check_math(record)


@pytest.mark.parametrize("name", list(CASES))
def test_missing_column_is_named(name, tmp_path):
    file_name, rows, _, column = CASES[name]
    src = write(tmp_path / file_name, [drop(row, column) for row in rows])
    out = tmp_path / "out.jsonl"
    with pytest.raises(DataError) as info:
        prepare(name, src, out)
    message = str(info.value)
    assert f"recipe {name!r}" in message and f"no column {column!r}" in message and str(src) in message
    assert "columns found" in message and not out.exists()


def test_ids_metadata_and_duplicates(tmp_path):
    src = write(tmp_path / "dapo.parquet", CASES["dapo-math-17k"][1])
    summary = run_recipe("dapo-math-17k", src, tmp_path / "dapo.jsonl")
    assert (summary.rows, summary.records, summary.duplicates) == (4, 3, 1)
    records = load_records(summary.out)
    assert records[0].id == "dapo-math-17k-9a9b6eb4-0001"
    assert records[0].messages[0]["content"] == "Find $x$ if $2x = 68$."  # no suffix by default, DAPO wrapper gone
    src = write(tmp_path / "math500.jsonl", CASES["math500"][1])
    first = load_records(prepare("math500", src, tmp_path / "math500_records.jsonl"))[0]
    assert first.id == "math500-test/precalculus/807.json"
    assert first.metadata == {
        "data_source": "math500",
        "source_id": "test/precalculus/807.json",
        "subject": "Precalculus",
        "level": 2,
    }
    summary = run_recipe("amc23", write(tmp_path / "amc.parquet", CASES["amc23"][1]), tmp_path / "amc.jsonl")
    assert (summary.skipped, summary.records) == (1, 3) and "from other years" in summary.line()


def test_release_variants(tmp_path):
    # MATH without an answer column: the last \boxed{} of the solution.
    rows = [{k: v for k, v in r.items() if k != "answer"} for r in CASES["math500"][1]]
    records = load_records(prepare("math500", write(tmp_path / "math.jsonl", rows), tmp_path / "m.jsonl"))
    assert [r.answer for r in records] == [a for _, a in CASES["math500"][2]]
    # math-ai/minervamath: question, answer.
    rows = [{"question": "Find the image diameter.", "answer": "1.6"}, {"question": "Find it.", "answer": "0.49"}]
    records = load_records(prepare("minerva-math", write(tmp_path / "mm.jsonl", rows), tmp_path / "mm_out.jsonl"))
    assert [(r.id, r.answer) for r in records] == [("minerva-math-0", "1.6"), ("minerva-math-1", "0.49")]
    # opencompass/AIME2025: two files, question / answer.
    one = write(tmp_path / "aime2025-I.jsonl", [{"question": "Find $b$.", "answer": "70"}])
    two = write(tmp_path / "aime2025-II.jsonl", [{"question": "Find $n$.", "answer": "468"}])
    records = load_records(prepare("aime25", [one, two], tmp_path / "aime25.jsonl"))
    assert [(r.id, r.answer) for r in records] == [("aime25-0", "70"), ("aime25-1", "468")]
    # Maxwell-Jia/AIME_2024: ID, Problem, Answer (an integer column).
    rows = [{"ID": "2024-I-1", "Problem": "Find the time.", "Solution": "...", "Answer": 204}]
    record = load_records(prepare("aime24", write(tmp_path / "mj.parquet", rows), tmp_path / "mj.jsonl"))[0]
    assert (record.id, record.answer) == ("aime24-2024-I-1", "204")


def test_directories(tmp_path):
    import datasets

    # A cloned repository without the recipe's default hub config (OE_TO_maths_en_COMP): read as it is.
    write(tmp_path / "repo" / "test.jsonl", CASES["olympiadbench"][1])
    summary = run_recipe("olympiadbench", tmp_path / "repo", tmp_path / "ob.jsonl")
    assert summary.records == 4
    # A save_to_disk DatasetDict: the recipe's split by default, --split to choose another.
    rows = CASES["minerva-math"][1]
    splits = {"train": datasets.Dataset.from_list(rows[:1]), "test": datasets.Dataset.from_list(rows)}
    datasets.DatasetDict(splits).save_to_disk(str(tmp_path / "saved"))
    assert run_recipe("minerva-math", tmp_path / "saved", tmp_path / "a.jsonl").records == 3
    assert run_recipe("minerva-math", tmp_path / "saved", tmp_path / "b.jsonl", split="train").records == 1
    with pytest.raises(DataError, match=r"no split 'dev'; available splits: \['train', 'test'\]"):
        run_recipe("minerva-math", tmp_path / "saved", tmp_path / "c.jsonl", split="dev")


def test_plain_limit_force_and_bad_rows(tmp_path):
    src = write(tmp_path / "gsm8k.parquet", CASES["gsm8k"][1])
    out = tmp_path / "gsm8k.jsonl"
    records = load_records(prepare("gsm8k", src, out, plain=True, limit=2))
    assert [(r.prompt, r.messages, r.answer) for r in records] == [
        ("Natalia sold clips to 48 friends.", None, "72"),
        ("How much did he pay in total?", None, "1000"),
    ]
    with pytest.raises(FileExistsError, match="--force"):
        prepare("gsm8k", src, out)
    assert len(load_records(prepare("gsm8k", src, out, force=True))) == 3
    bad = write(tmp_path / "bad.jsonl", [{"question": "Q?", "answer": "24"}])
    with pytest.raises(DataError, match=r"recipe 'gsm8k': .*bad\.jsonl, row 0: column 'answer' has no '#### <number>'"):
        prepare("gsm8k", bad, tmp_path / "bad_out.jsonl")
    with pytest.raises(ValueError, match="unknown recipe 'aime'; recipes: dapo-math-17k, aime24"):
        prepare("aime", src, tmp_path / "x.jsonl")
    with pytest.raises(ValueError, match="unknown suffix"):
        prepare("gsm8k", src, tmp_path / "x.jsonl", suffix="long")
    with pytest.raises(DataError, match="file not found"):
        prepare("gsm8k", tmp_path / "nowhere.parquet", tmp_path / "x.jsonl")


def test_dispatch_and_usage(tmp_path, capsys):
    text = cli.usage()
    assert "prepare" in cli.PLAIN_SUBCOMMANDS and "  prepare  " in text and "  fit " in text
    with pytest.raises(ValueError, match="plain arguments"):
        cli.run("prepare", None)
    with pytest.raises(SystemExit) as info:
        cli_main(["prepare", "--list"])
    assert info.value.code == 0
    listing = capsys.readouterr().out
    assert listing == describe_recipes() + "\n"
    for name in RECIPES:
        assert f"\n{name}  (" in listing
    assert "question, final_answer" in listing and "reward_model.ground_truth" in listing
    src = write(tmp_path / "aime.jsonl", CASES["aime25"][1])
    out = tmp_path / "aime.jsonl.out.jsonl"
    assert cli.run_plain("prepare", ["aime25", "--src", str(src), "--out", str(out)]) == 0
    assert cli.run_plain("prepare", ["aime25", "--src", str(src), "--out", str(out)]) == 1
    assert "exists; pass --force" in capsys.readouterr().err
    assert cli.run_plain("prepare", ["aime25", "--src", str(src)]) == 2


def test_command_line(tmp_path):
    src = write(tmp_path / "test-00000-of-00001.parquet", CASES["gsm8k"][1])
    out = tmp_path / "data" / "gsm8k.jsonl"
    command = [sys.executable, "-m", "stare_lightning", "prepare", "gsm8k", "--src", str(src), "--out", str(out)]
    done = subprocess.run([*command, "--suffix", "paper"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert f"gsm8k: wrote 3 records to {out}" in done.stdout
    records = load_records(out)
    assert records[0].messages[0]["content"] == f"Natalia sold clips to 48 friends.\n\n{PAPER_SUFFIX}"
    assert [r.answer for r in records] == ["72", "1000", "9"]
