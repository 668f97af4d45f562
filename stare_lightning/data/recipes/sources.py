"""Reading a release with the ``datasets`` library: parquet / JSON / JSONL files, a ``save_to_disk`` or cloned
repository directory, or a hub id (which needs a network). Files and hub ids are streamed, so nothing is
copied into the ``datasets`` cache and ``--limit`` stops early.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ..readers import DataError

_BUILDERS = {".parquet": "parquet", ".jsonl": "json", ".ndjson": "json", ".json": "json"}
_SAVED_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")


def _import_datasets(label: str):
    try:
        import datasets
    except ImportError:
        raise DataError(
            f"{label}: `prepare` reads releases with the `datasets` package: pip install 'stare_lightning[datasets]'"
        ) from None
    return datasets


def _pick_split(ds: Any, label: str, split: str | None, default: str) -> Any:
    if not isinstance(ds, Mapping):  # a single split already (DatasetDict and IterableDatasetDict are dicts)
        return ds
    splits = list(ds.keys())
    if split is not None:
        if split not in splits:
            raise DataError(f"{label}: no split {split!r}; available splits: {splits}")
        return ds[split]
    if default in splits:
        return ds[default]
    if len(splits) == 1:
        return ds[splits[0]]
    raise DataError(f"{label}: has splits {splits}; choose one with --split")


def _load_files(datasets: Any, paths: Sequence[Path], label: str, cache: str) -> Any:
    builders = {_BUILDERS.get(p.suffix.lower()) for p in paths}
    if None in builders:
        bad = [str(p) for p in paths if p.suffix.lower() not in _BUILDERS]
        raise DataError(f"{', '.join(bad)}: unsupported file type; use one of {', '.join(_BUILDERS)}")
    if len(builders) > 1:
        raise DataError(f"{label}: mixes parquet and JSON files; pass files of one kind")
    files = [str(p) for p in paths]
    return datasets.load_dataset(builders.pop(), data_files=files, split="train", streaming=True, cache_dir=cache)


def _load_repo(datasets: Any, source: str, config: str | None, default_config: str | None, cache: str) -> Any:
    """A hub id or cloned repository; the recipe's default config is dropped when this release has no such config."""
    if config is not None or default_config is None:
        return datasets.load_dataset(source, name=config, streaming=True, cache_dir=cache)
    try:
        return datasets.load_dataset(source, name=default_config, streaming=True, cache_dir=cache)
    except ValueError as first:  # e.g. "BuilderConfig 'main' not found": another release of the same benchmark
        try:
            return datasets.load_dataset(source, streaming=True, cache_dir=cache)
        except Exception:  # noqa: BLE001 - report the first failure, with the recipe's config
            raise first from None


def _load(srcs: Sequence[str], label: str, split: str | None, configs: tuple, default_split: str, cache: str):
    datasets = _import_datasets(label)
    paths = [Path(s).expanduser() for s in srcs]
    if all(p.is_file() for p in paths):
        return _load_files(datasets, paths, label, cache)
    if len(paths) > 1:
        missing = [str(p) for p in paths if not p.is_file()]
        raise DataError(f"file not found: {', '.join(missing)} (several --src must all be files)")
    path, source = paths[0], srcs[0]
    if path.is_dir() and any((path / m).exists() for m in _SAVED_MARKERS):
        ds = datasets.load_from_disk(str(path))
    elif path.is_dir():  # a cloned hub repository: `datasets` finds its data files and splits
        ds = _load_repo(datasets, str(path), *configs, cache)
    elif path.suffix.lower() in _BUILDERS or source.startswith((".", "/", "~")) or source.count("/") > 1:
        raise DataError(f"file not found: {source} (working directory: {os.getcwd()})")
    else:
        ds = _load_repo(datasets, source, *configs, cache)
    return _pick_split(ds, label, split, default_split)


def _rows(ds: Any, label: str) -> Iterator[dict]:
    iterator = iter(ds)
    while True:
        try:
            row = next(iterator)
        except StopIteration:
            return
        except Exception as exc:  # noqa: BLE001 - parse errors of every builder land here
            raise DataError(f"{label}: cannot read it ({type(exc).__name__}: {str(exc)[:300]})") from None
        yield row


@contextmanager
def open_rows(
    srcs: Sequence[str],
    *,
    split: str | None,
    config: str | None,
    default_split: str,
    default_config: str | None = None,
) -> Iterator[Iterator[dict]]:
    """The rows of ``srcs`` (several files are read one after the other), as plain dicts.

    ``split``/``config`` are the user's; without them a repository or hub id is read with the recipe's
    ``default_split`` (else its only split) and ``default_config`` (when the release has it).
    """
    label = ", ".join(srcs)
    with tempfile.TemporaryDirectory(prefix="stare_prepare_") as cache:
        try:
            ds = _load(srcs, label, split, (config, default_config), default_split, cache)
        except DataError:
            raise
        except Exception as exc:  # noqa: BLE001 - network, auth and format errors all land here
            offline = os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on")
            hint = " (HF_HUB_OFFLINE is set; hub ids need a network)" if offline else ""
            raise DataError(f"{label}: cannot load it with `datasets`{hint}: {type(exc).__name__}: {exc}") from None
        yield _rows(ds, label)
