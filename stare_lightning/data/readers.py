"""Where raw rows come from: JSONL, JSON, Parquet, ``datasets`` directories and hub ids, each row with a
location label (``line N`` for JSONL, 1-based as in an editor; ``item N`` / ``row N``, 0-based, otherwise); and a
row's column by its dotted path into nested objects (``reward_model.ground_truth``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

FILE_SUFFIXES = (".jsonl", ".ndjson", ".json", ".parquet")
_DATASETS_DIR_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")


class DataError(ValueError):
    """Bad input data; the message names the source, the location and the key."""


def column_value(row: Mapping, path: str) -> tuple[bool, Any]:
    """(found, value) of a dotted column path in a row."""
    node: Any = row
    for part in path.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return False, None
        node = node[part]
    return True, node


# Records are flat (a prompt, an answer, a little metadata); nesting deeper than this is refused where it is read,
# before the parser's or any later copy's recursion limit turns it into a bare RecursionError.
MAX_NESTING = 32


def _nesting(value: Any) -> int:
    """How deeply lists and dicts nest in ``value`` (0 for a scalar), without recursion."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, (list, dict)):
            deepest = max(deepest, depth + 1)
            if deepest > MAX_NESTING:
                return deepest
            stack.extend((child, depth + 1) for child in (node.values() if isinstance(node, dict) else node))
    return deepest


def _too_deep(where: str) -> DataError:
    return DataError(f"{where}: JSON nested more than {MAX_NESTING} levels deep (records are prompts and answers)")


def _checked(where: str, value: Any) -> Any:
    if _nesting(value) > MAX_NESTING:
        raise _too_deep(where)
    return value


def _jsonl_rows(path: Path) -> Iterator[tuple[str, Any]]:
    lineno = 0
    try:
        with open(path, encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, start=1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except RecursionError:
                    raise _too_deep(f"{path}, line {lineno}") from None
                except json.JSONDecodeError as exc:
                    problem = f"malformed JSON ({exc.msg} at column {exc.colno})"
                    raise DataError(f"{path}, line {lineno}: {problem}") from None
                yield f"line {lineno}", _checked(f"{path}, line {lineno}", row)
    except UnicodeDecodeError as exc:
        raise DataError(f"{path}, line {lineno + 1}: not valid UTF-8 ({exc.reason})") from None


def _json_rows(path: Path) -> Iterator[tuple[str, Any]]:
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except UnicodeDecodeError as exc:
        raise DataError(f"{path}: not valid UTF-8 ({exc.reason})") from None
    except RecursionError:
        raise _too_deep(str(path)) from None
    except json.JSONDecodeError as exc:
        hint = " (one object per line? name the file .jsonl)" if exc.msg.startswith("Extra data") else ""
        raise DataError(f"{path}, line {exc.lineno}, column {exc.colno}: malformed JSON ({exc.msg}){hint}") from None
    if not isinstance(data, list):
        raise DataError(f"{path}: expected a JSON list of records at the top level, got {type(data).__name__}")
    for i, row in enumerate(data):
        yield f"item {i}", _checked(f"{path}, item {i}", row)


def _parquet_rows(path: Path) -> Iterator[tuple[str, Any]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as exc:
        raise DataError(f"{path}: not a readable Parquet file ({exc})") from None
    for i, row in enumerate(table.to_pylist()):
        yield f"row {i}", row


def _pick_split(ds: Any, source: str, split: str | None) -> Any:
    import datasets

    if isinstance(ds, (datasets.DatasetDict, datasets.IterableDatasetDict)):
        splits = list(ds.keys())
        if split is None:
            if "train" in splits or len(splits) == 1:
                return ds["train" if "train" in splits else splits[0]]
            raise DataError(f"{source}: has splits {splits}; choose one (data.train_split / data.val_split)")
        if split not in splits:
            raise DataError(f"{source}: no split {split!r}; available splits: {splits}")
        return ds[split]
    return ds


def _datasets_rows(source: str, split: str | None, *, local: bool) -> Iterator[tuple[str, Any]]:
    try:
        import datasets
    except ImportError:
        raise DataError(
            f"{source}: loading a `datasets` {'directory' if local else 'hub id'} needs the `datasets` package "
            "(pip install 'stare_lightning[datasets]'), or pass a .jsonl/.json/.parquet file"
        ) from None
    if local:
        try:
            ds = datasets.load_from_disk(source)
        except Exception as exc:  # noqa: BLE001 - the library raises many kinds
            raise DataError(f"{source}: cannot load this `datasets` directory ({type(exc).__name__}: {exc})") from None
    else:
        offline = os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on") or os.environ.get(
            "HF_DATASETS_OFFLINE", "0"
        ).lower() in ("1", "true", "yes", "on")
        try:
            ds = datasets.load_dataset(source, split=split)
        except Exception as exc:  # noqa: BLE001 - network, auth and format errors all land here
            why = "HF_HUB_OFFLINE is set" if offline else "no network, an unknown id, or a gated data set"
            raise DataError(
                f"{source!r} is not a local file or directory, and loading it as a Hugging Face hub data set failed "
                f"({why}: {type(exc).__name__}: {str(exc)[:200]}). Hub data sets need a network: on a machine "
                "with one, run `datasets.load_dataset(...).save_to_disk(DIR)` and pass DIR, or export a "
                ".jsonl/.parquet file."
            ) from None
    ds = _pick_split(ds, source, split)
    for i, row in enumerate(ds):
        yield f"row {i}", row


def rows_of(source: str, split: str | None) -> Iterator[tuple[str, Any]]:
    """(location, raw row) pairs of a file, a ``datasets`` directory or a hub id."""
    path = Path(source).expanduser()
    if path.is_file():
        suffix = path.suffix.lower()
        if suffix in (".jsonl", ".ndjson"):
            return _jsonl_rows(path)
        if suffix == ".json":
            return _json_rows(path)
        if suffix == ".parquet":
            return _parquet_rows(path)
        raise DataError(f"{source}: unsupported file type {suffix!r}; use one of {', '.join(FILE_SUFFIXES)}")
    if path.is_dir():
        if not any((path / marker).exists() for marker in _DATASETS_DIR_MARKERS):
            raise DataError(
                f"{source}: a directory, but not one written by `datasets` save_to_disk "
                f"(none of {', '.join(_DATASETS_DIR_MARKERS)} inside)"
            )
        return _datasets_rows(str(path), split, local=True)
    looks_local = path.suffix.lower() in FILE_SUFFIXES or source.startswith((".", "/", "~", "\\"))
    if looks_local or source.count("/") > 1:  # hub ids are "name" or "owner/name"
        raise DataError(f"data file not found: {source} (working directory: {os.getcwd()})")
    return _datasets_rows(source, split, local=False)
