"""A logged run as a table: find Lightning CSVLogger directories, name them, load ``metrics.csv`` one row per step.

Also a run's arm (its algorithm, as ``compare`` and the summaries group runs) from its ``hparams.yaml``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pandas as pd

METRICS_FILE = "metrics.csv"
_NAME_KEYS = ("run_name", "name", "experiment_name", "experiment")


def find_run_dirs(paths: str | os.PathLike | Iterable[str | os.PathLike]) -> list[Path]:
    """Run directories under ``paths``: each path is a run (holds metrics.csv) or is searched for runs.

    A string may hold several paths separated by ``os.pathsep`` (as in ``STARE_RUN_DIRS``).
    """
    if isinstance(paths, (str, os.PathLike)):
        paths = [p for p in str(paths).split(os.pathsep) if p.strip()]
    found: list[Path] = []
    for p in paths:
        root = Path(p).expanduser()
        if (root / METRICS_FILE).is_file():
            found.append(root)
        elif root.is_dir():
            found.extend(sorted(f.parent for f in root.rglob(METRICS_FILE)))
        else:
            raise FileNotFoundError(f"no run directory at {root}")
    return found


def run_name(run_dir: str | os.PathLike) -> str:
    """A run's display name: a name in its ``hparams.yaml``, else its folder name.

    A CSVLogger folder named ``version_N`` is shown with its parent: ``<parent>/version_N``.
    """
    run_dir = Path(run_dir)
    hparams = run_dir / "hparams.yaml"
    if hparams.is_file():
        import yaml

        try:
            data = yaml.safe_load(hparams.read_text()) or {}
        except yaml.YAMLError:
            data = {}
        if isinstance(data, dict):
            for key in _NAME_KEYS:
                value = data.get(key)
                if isinstance(value, str) and value.strip():
                    return value.strip()
    if re.fullmatch(r"version_\d+", run_dir.name) and run_dir.parent.name:
        return f"{run_dir.parent.name}/{run_dir.name}"
    return run_dir.name


def load_run(run_dir: str | os.PathLike) -> pd.DataFrame:
    """One row per step (the index, sorted), one column per logged metric.

    CSVLogger writes sparse rows (NaN where a metric was not logged in that row) and may write several
    rows for one step; they are merged, keeping the last value logged for each metric at that step.
    The run's name is in ``df.attrs["name"]``.
    """
    import pandas as pd

    run_dir = Path(run_dir)
    path = run_dir / METRICS_FILE if run_dir.is_dir() else run_dir
    raw = pd.read_csv(path)
    if "step" not in raw.columns:
        raise ValueError(f"{path} has no 'step' column")
    raw = raw.dropna(subset=["step"])
    raw["step"] = raw["step"].astype("int64")
    df = raw.groupby("step", sort=True).last()
    df.attrs["name"] = run_name(path.parent)
    return df


def load_runs(paths: str | os.PathLike | Iterable[str | os.PathLike]) -> dict[str, pd.DataFrame]:
    """``{run name: frame}`` for every run found under ``paths``; clashing names get a ``#i`` suffix."""
    runs: dict[str, pd.DataFrame] = {}
    for run_dir in find_run_dirs(paths):
        df = load_run(run_dir)
        name, i = df.attrs["name"], 2
        while name in runs:
            name, i = f"{df.attrs['name']}#{i}", i + 1
        runs[name] = df
    return runs


def arm_label(logged: dict | None, fallback: str) -> str:
    """A run's arm from its logged hyper-parameters: the algorithm's name, ``_adaptive`` added when STARE's
    schedule is adaptive (the same recipe with another W schedule is another arm); ``fallback`` without a name."""
    algorithm = (logged or {}).get("algorithm") or {}
    adaptive = "_adaptive" if (algorithm.get("stare") or {}).get("adaptive") else ""
    return f"{algorithm.get('name') or fallback}{adaptive}"
