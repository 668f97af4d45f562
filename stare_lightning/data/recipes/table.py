"""The recipe table: for each benchmark, the public releases' column names and how a row becomes a record.

A :class:`Recipe` lists :class:`Layout` s, one per release layout it reads; the first layout whose problem
and answer columns are all in the source's first row is used for every row. Column names are dotted paths
into nested objects (``reward_model.ground_truth``). A layout's ``id`` and ``extras`` columns are optional:
ids fall back to the row number, extras present in a row are copied into the record's metadata.
Each recipe's ``doc`` (its docstring, printed by ``prepare --list``) says which releases it follows.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ...rewards.extract import last_boxed

PAPER_SUFFIX = "Please reason step by step, and put your final answer within \\boxed{}."
SUFFIXES: dict[str, str] = {"none": "", "paper": PAPER_SUFFIX}

# DAPO-Math-17k wraps every problem in an instruction to end with an "Answer:" line.
_DAPO_HEAD = "Solve the following math problem step by step."
_DAPO_TAIL = '\n\nRemember to put your answer on its own line after "Answer:"'


class RowError(ValueError):
    """A bad value in one row; the caller adds the recipe, the file and the row."""


def _text(value: Any, column: str) -> str:
    if value is None:
        raise RowError(f"column {column!r} is empty (null)")
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise RowError(f"column {column!r} must be text or a number, got {type(value).__name__}")
    if isinstance(value, float) and value.is_integer():
        value = int(value)  # AMC answers ship as float64: 27.0 -> "27"
    text = str(value).strip()
    if not text:
        raise RowError(f"column {column!r} is empty")
    return text


def _unwrap_dollars(text: str) -> str:
    while len(text) >= 2 and text.startswith("$") and text.endswith("$"):
        text = text[1:-1].strip()
    return text


def plain_problem(value: Any, column: str) -> str:
    """The problem text as it is."""
    return _text(value, column)


def strip_dapo_template(text: str) -> str:
    """The bare problem of a DAPO prompt: its "Answer:" instruction before and after removed."""
    if text.startswith(_DAPO_HEAD):
        _, sep, rest = text.partition("\n\n")
        if sep:
            text = rest
    cut = text.rfind(_DAPO_TAIL)
    if cut != -1:
        text = text[:cut]
    return text.strip()


def chat_problem(value: Any, column: str) -> str:
    """The last user message of a chat (or a string), with DAPO's instruction wrapper removed."""
    if isinstance(value, (list, tuple)):
        users = [m for m in value if isinstance(m, Mapping) and m.get("role") == "user"]
        if not users:
            raise RowError(f"column {column!r} is a chat without a user message")
        value = users[-1].get("content")
    problem = strip_dapo_template(_text(value, column))
    if not problem:
        raise RowError(f"column {column!r} holds only the DAPO instruction, no problem")
    return problem


def plain_answer(value: Any, column: str) -> str:
    """The answer as text (integral floats as integers, surrounding ``$`` removed)."""
    answer = _unwrap_dollars(_text(value, column))
    if not answer:
        raise RowError(f"column {column!r} is empty")
    return answer


def boxed_answer(value: Any, column: str) -> str:
    """The last ``\\boxed{}`` of a worked solution."""
    answer = last_boxed(_text(value, column))
    if not answer:
        raise RowError(f"column {column!r} has no \\boxed{{...}} final answer")
    return answer


def gsm8k_answer(value: Any, column: str) -> str:
    """The number after ``####`` at the end of a GSM8K solution, thousands commas removed."""
    text = _text(value, column)
    if "####" not in text:
        raise RowError(f"column {column!r} has no '#### <number>' final answer")
    answer = text.rsplit("####", 1)[1].strip().replace(",", "")
    if not answer:
        raise RowError(f"column {column!r} has nothing after '####'")
    return answer


def list_answer(value: Any, column: str) -> str:
    """A list of final answers (OlympiadBench) joined with ", ", each without its ``$...$``; or one answer."""
    if isinstance(value, (list, tuple)):
        parts = [plain_answer(v, column) for v in value]
        if not parts:
            raise RowError(f"column {column!r} is an empty list")
        return ", ".join(parts)
    return plain_answer(value, column)


_ANSWER_NOTES: dict[Callable, str] = {
    boxed_answer: "its last \\boxed{}",
    gsm8k_answer: "the number after ####",
    list_answer: "a list, joined with ', '",
}


@dataclass(frozen=True)
class Layout:
    """The columns of one release: problem and answer are required, id and extras are used when present."""

    release: str
    problem: str
    answer: str
    id: str | None = None
    extras: tuple[str, ...] = ()
    read_problem: Callable[[Any, str], str] = plain_problem
    read_answer: Callable[[Any, str], str] = plain_answer

    @property
    def required(self) -> tuple[str, str]:
        return (self.problem, self.answer)

    def describe(self) -> str:
        note = _ANSWER_NOTES.get(self.read_answer)
        how = f" ({self.answer}: {note})" if note else ""
        optional = [c for c in (self.id, *self.extras) if c]
        more = f"; optional: {', '.join(optional)}" if optional else ""
        return f"{self.problem}, {self.answer}{how}{more}  [{self.release}]"


@dataclass(frozen=True)
class Recipe:
    """One benchmark: its layouts, the split and hub config it reads by default, an optional year filter."""

    name: str
    doc: str
    layouts: tuple[Layout, ...]
    split: str = "test"
    hub_config: str | None = None
    year: str | None = None  # rows whose `url` column names another year are skipped

    def keeps(self, row: Mapping) -> bool:
        url = row.get("url") if self.year else None
        return not isinstance(url, str) or self.year in url


_VERL = "reward_model.ground_truth"

RECIPES: dict[str, Recipe] = {
    r.name: r
    for r in (
        Recipe(
            "dapo-math-17k",
            "DAPO-Math-17k, the training set (integer answers). Follows BytedTsinghua-SIA/DAPO-Math-17k: verl "
            "parquet with `prompt` a one-message chat, `reward_model.ground_truth`, `extra_info.index`; that "
            "release repeats its ~17k problems ~100 times (1.79M rows), so exact duplicates are dropped. The "
            "deduplicated copies with the same columns and open-r1/DAPO-Math-17k-Processed (`prompt` as text, "
            "`solution`) read the same way. DAPO's 'Answer:' instruction around each problem is removed: the "
            "prompt is the bare problem plus --suffix.",
            (
                Layout("BytedTsinghua-SIA/DAPO-Math-17k (verl)", "prompt", _VERL, "extra_info.index", (), chat_problem),
                Layout("open-r1/DAPO-Math-17k-Processed", "prompt", "solution", "extra_info.index", (), chat_problem),
            ),
            split="train",
        ),
        Recipe(
            "aime24",
            "AIME 2024 (30 problems, integer answers). Follows HuggingFaceH4/aime_2024 (id, problem, solution, "
            "answer, url, year; split train); also AI-MO/aimo-validation-aime (AIME 2022-2024: rows whose url "
            "names another year are skipped), the Qwen2.5-Math harness file data/aime24/test.jsonl (problem, "
            "answer), Maxwell-Jia/AIME_2024 (ID, Problem, Answer) and DAPO's verl file (repeated 32x; duplicates "
            "dropped).",
            (
                Layout("HuggingFaceH4/aime_2024, Qwen2.5-Math harness", "problem", "answer", "id", ("url",)),
                Layout("Maxwell-Jia/AIME_2024", "Problem", "Answer", "ID"),
                Layout("BytedTsinghua-SIA/AIME-2024 (verl)", "prompt", _VERL, None, (), chat_problem),
            ),
            split="train",
            year="2024",
        ),
        Recipe(
            "aime25",
            "AIME 2025 (30 problems, integer answers). Follows math-ai/aime25 (problem, answer, id; split test); "
            "also opencompass/AIME2025 (question, answer; pass both aime2025-I.jsonl and aime2025-II.jsonl to "
            "--src).",
            (
                Layout("math-ai/aime25", "problem", "answer", "id"),
                Layout("opencompass/AIME2025", "question", "answer", "id"),
            ),
        ),
        Recipe(
            "amc23",
            "AMC 2023 (40 problems). Follows the Qwen2.5-Math harness file data/amc23/test.jsonl and "
            "AI-MO/aimo-validation-amc (problem, answer as float64, id, url; AMC 2022+2023: rows whose url does "
            "not name 2023 are skipped); also math-ai/amc23 (question, answer).",
            (
                Layout("Qwen2.5-Math harness, AI-MO/aimo-validation-amc", "problem", "answer", "id", ("url",)),
                Layout("math-ai/amc23", "question", "answer", "id"),
            ),
            year="2023",
        ),
        Recipe(
            "math500",
            "MATH-500 (500 problems). Follows HuggingFaceH4/MATH-500 (problem, solution, answer, subject, level, "
            "unique_id; test.jsonl), also the Qwen2.5-Math harness copy. A MATH-style file without an `answer` "
            "column (problem, solution) gets the last \\boxed{} of the solution.",
            (
                Layout("HuggingFaceH4/MATH-500", "problem", "answer", "unique_id", ("subject", "level")),
                Layout(
                    "MATH-style (no answer column)",
                    "problem",
                    "solution",
                    "unique_id",
                    ("level", "type"),
                    plain_problem,
                    boxed_answer,
                ),
            ),
        ),
        Recipe(
            "minerva-math",
            "Minerva-Math (272 problems). Follows the Qwen2.5-Math harness file data/minerva_math/test.jsonl "
            "(problem, solution with a \\boxed{} answer, idx, type) and math-ai/minervamath (question, answer); "
            "an `answer` column wins over the solution's \\boxed{}.",
            (
                Layout("problem + answer", "problem", "answer", "idx", ("type",)),
                Layout("math-ai/minervamath", "question", "answer", "idx", ("type",)),
                Layout("Qwen2.5-Math harness", "problem", "solution", "idx", ("type",), plain_problem, boxed_answer),
                Layout("question + solution", "question", "solution", "idx", ("type",), plain_problem, boxed_answer),
            ),
        ),
        Recipe(
            "olympiadbench",
            "OlympiadBench, English text-only competition math. Follows Hothan/OlympiadBench (config "
            "OE_TO_maths_en_COMP, split train) and the Qwen2.5-Math harness file data/olympiadbench/test.jsonl: "
            "id, question, final_answer as a list. All entries of final_answer are joined with ', ' (the Qwen "
            "harness keeps only the first), so a multi-part answer needs every part. Also math-ai/olympiadbench "
            "(question, answer).",
            (
                Layout(
                    "Hothan/OlympiadBench, Qwen2.5-Math harness",
                    "question",
                    "final_answer",
                    "id",
                    ("subfield", "answer_type", "is_multiple_answer", "unit"),
                    plain_problem,
                    list_answer,
                ),
                Layout("math-ai/olympiadbench", "question", "answer", "id"),
            ),
            hub_config="OE_TO_maths_en_COMP",
        ),
        Recipe(
            "gsm8k",
            "GSM8K (test: 1319 problems). Follows openai/gsm8k (question, answer ending in '#### <number>'; "
            "configs main and socratic, splits train and test): the answer is the number after '####', commas "
            "removed.",
            (Layout("openai/gsm8k", "question", "answer", None, (), plain_problem, gsm8k_answer),),
            hub_config="main",
        ),
    )
}


def get_recipe(name: str) -> Recipe:
    """The recipe called ``name`` (case and ``_``/``-`` do not matter); ValueError listing the known ones."""
    key = str(name).strip().lower().replace("_", "-")
    if key not in RECIPES:
        raise ValueError(f"unknown recipe {name!r}; recipes: {', '.join(RECIPES)}")
    return RECIPES[key]
