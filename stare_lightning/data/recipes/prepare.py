"""``prepare``: a public release -> prompt records (JSONL) through one recipe, validated before it is written.

Every record is ``{"id", "messages" (one user message) or "prompt" (``plain``), "answer", "verifier": "math",
"metadata": {"data_source": <recipe>, "source_id": ..., <extra columns>}}``. The prompt is the problem,
then a blank line and the suffix when one is asked for. Rows repeating an earlier (problem, answer) pair are
dropped. Nothing is written until every row has been converted and the records load back through
:func:`stare_lightning.data.load_records`; an existing output is replaced only with ``force``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..readers import DataError, column_value
from ..records import load_records
from .sources import open_rows
from .table import SUFFIXES, Layout, Recipe, RowError, get_recipe

VERIFIER = "math"


@dataclass
class Summary:
    """What a run of a recipe did, for the command's report."""

    recipe: str
    out: Path
    layout: str = ""
    rows: int = 0
    records: int = 0
    duplicates: int = 0
    skipped: int = 0

    def line(self) -> str:
        notes = [f"read {self.rows} rows as {self.layout}"]
        if self.duplicates:
            notes.append(f"dropped {self.duplicates} duplicate rows")
        if self.skipped:
            notes.append(f"skipped {self.skipped} rows from other years")
        return f"{self.recipe}: wrote {self.records} records to {self.out} ({'; '.join(notes)})"


def _choose_layout(recipe: Recipe, row: Mapping, label: str) -> Layout:
    best: list[str] | None = None
    for layout in recipe.layouts:
        missing = [c for c in layout.required if not column_value(row, c)[0]]
        if not missing:
            return layout
        if best is None or len(missing) < len(best):
            best = missing
    expected = " | ".join(f"{', '.join(lay.required)} [{lay.release}]" for lay in recipe.layouts)
    names = ", ".join(repr(c) for c in best or ())
    raise DataError(
        f"recipe {recipe.name!r}: {label} has no column {names}; expected columns: {expected}; "
        f"columns found: {sorted(row)}. `python -m stare_lightning prepare --list` shows every recipe's columns"
    )


def _value(row: Mapping, column: str) -> Any:
    found, value = column_value(row, column)
    if not found:
        raise RowError(f"no column {column!r}; the row has columns {sorted(row)}")
    return value


def _source_id(layout: Layout, row: Mapping) -> str | None:
    if layout.id is None:
        return None
    found, value = column_value(row, layout.id)
    if not found or value is None or isinstance(value, bool) or not isinstance(value, (str, int, float)):
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value).strip() or None


def _record(recipe: Recipe, layout: Layout, row: Mapping, index: int, suffix: str, plain: bool) -> dict:
    problem = layout.read_problem(_value(row, layout.problem), layout.problem)
    answer = layout.read_answer(_value(row, layout.answer), layout.answer)
    text = f"{problem}\n\n{suffix}" if suffix else problem
    source_id = _source_id(layout, row)
    metadata: dict[str, Any] = {"data_source": recipe.name}
    if source_id is not None:
        metadata["source_id"] = source_id
    for column in layout.extras:
        found, value = column_value(row, column)
        if found and value is not None:
            metadata[column] = value
    record: dict[str, Any] = {"id": f"{recipe.name}-{source_id if source_id is not None else index}"}
    record.update({"prompt": text} if plain else {"messages": [{"role": "user", "content": text}]})
    record.update({"answer": answer, "verifier": VERIFIER, "metadata": metadata})
    return record


def _collect(recipe: Recipe, rows: Iterable[Any], label: str, options: dict, summary: Summary) -> list[dict]:
    records: list[dict] = []
    seen: set = set()
    first_row: dict[str, int] = {}
    layout: Layout | None = None
    for index, row in enumerate(rows):
        where = f"recipe {recipe.name!r}: {label}, row {index}"
        if not isinstance(row, Mapping):
            raise DataError(f"{where}: expected an object with columns, got {type(row).__name__}")
        if layout is None:
            layout = _choose_layout(recipe, row, label)
            summary.layout = f"{', '.join(layout.required)} [{layout.release}]"
        summary.rows += 1
        if not recipe.keeps(row):
            summary.skipped += 1
            continue
        try:
            record = _record(recipe, layout, row, index, options["suffix"], options["plain"])
        except RowError as exc:
            raise DataError(f"{where}: {exc}") from None
        key = (json.dumps(record.get("messages") or record.get("prompt")), record["answer"])
        if key in seen:
            summary.duplicates += 1
            continue
        seen.add(key)
        if record["id"] in first_row:
            raise DataError(f"{where}: id {record['id']!r} is already used by row {first_row[record['id']]}")
        first_row[record["id"]] = index
        records.append(record)
        if options["limit"] is not None and len(records) >= options["limit"]:
            break
    if layout is None:
        raise DataError(f"recipe {recipe.name!r}: {label} has no rows")
    if not records:
        raise DataError(f"recipe {recipe.name!r}: {label}: no rows left ({summary.skipped} from other years)")
    return records


def _write(records: list[dict], out: Path, name: str) -> None:
    partial = out.with_name(f".{out.stem}.partial.jsonl")
    try:
        with open(partial, "w", encoding="utf-8") as fh:
            for record in records:
                fh.write(json.dumps(record, ensure_ascii=False, default=str) + "\n")
        try:
            loaded = load_records(partial)
        except DataError as exc:
            raise DataError(f"recipe {name!r}: the records failed validation, nothing written: {exc}") from None
        if len(loaded) != len(records):
            raise DataError(f"recipe {name!r}: wrote {len(records)} records but {len(loaded)} load back")
        os.replace(partial, out)
    finally:
        if partial.exists():
            partial.unlink()


def _check_options(out: Path, suffix: str, limit: int | None, force: bool) -> None:
    if suffix not in SUFFIXES:
        raise ValueError(f"unknown suffix {suffix!r}; choose one of {list(SUFFIXES)}")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ValueError(f"limit must be a positive integer, got {limit!r}")
    if out.suffix.lower() != ".jsonl":
        raise ValueError(f"{out}: the output is JSONL; name it *.jsonl")
    if out.is_dir():
        raise FileExistsError(f"{out} is a directory; give a *.jsonl file path")
    if out.exists() and not force:
        raise FileExistsError(f"{out} exists; pass --force (force=True) to overwrite it")


def run_recipe(
    name: str,
    src: str | os.PathLike | Sequence[str | os.PathLike],
    out: str | os.PathLike,
    *,
    suffix: str = "none",
    plain: bool = False,
    limit: int | None = None,
    force: bool = False,
    split: str | None = None,
    config: str | None = None,
) -> Summary:
    """:func:`prepare`, returning what it did (rows read, records written, duplicates dropped)."""
    recipe = get_recipe(name)
    out = Path(out).expanduser()
    _check_options(out, suffix, limit, force)
    srcs = [os.fspath(src)] if isinstance(src, (str, os.PathLike)) else [os.fspath(s) for s in src]
    if not srcs:
        raise ValueError("no source given")
    summary = Summary(recipe.name, out)
    options = {"suffix": SUFFIXES[suffix], "plain": plain, "limit": limit}
    source = {"split": split, "config": config, "default_split": recipe.split, "default_config": recipe.hub_config}
    with open_rows(srcs, **source) as rows:
        records = _collect(recipe, rows, ", ".join(srcs), options, summary)
    out.parent.mkdir(parents=True, exist_ok=True)
    _write(records, out, recipe.name)
    summary.records = len(records)
    return summary


def prepare(
    name: str,
    src: str | os.PathLike | Sequence[str | os.PathLike],
    out: str | os.PathLike,
    **options: Any,
) -> Path:
    """Convert the release ``src`` with recipe ``name`` into validated prompt records at ``out``.

    Args:
        name: a recipe of :data:`RECIPES` (``prepare --list``).
        src: a parquet / JSON / JSONL file (or several of one kind), a ``datasets`` directory or a hub id.
        out: the ``.jsonl`` file to write.
        **options: ``suffix`` ("none" or "paper": the paper's short-CoT instruction after the problem),
            ``plain`` (a ``prompt`` string instead of one user message), ``limit`` (keep the first N records),
            ``force`` (replace an existing ``out``), ``split`` and ``config`` (of a hub id or directory).

    Raises:
        DataError naming the recipe, the source, the row and the column; FileExistsError for an existing
        ``out`` without ``force``; ValueError for a bad option.
    """
    return run_recipe(name, src, out, **options).out
