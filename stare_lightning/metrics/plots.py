"""Load logged runs (Lightning CSVLogger directories) and plot the entropy story of several runs side by side.

Not from the paper; the panels follow the telemetry of docs/method.md, section 5: entropy, predicted vs
realised entropy change, quadrant mass (token share, weight share, dH), reflection words, and accuracy
(val avg@n, val pass@k). Works on whatever subset of columns a run logged (a missing metric leaves its panel
marked "not logged"). matplotlib's object API (no pyplot state): headless, callable right after a fit.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from stare_lightning.metrics.functional import QUADRANTS

if TYPE_CHECKING:
    import pandas as pd
    from matplotlib.axes import Axes

METRICS_FILE = "metrics.csv"
_NAME_KEYS = ("run_name", "name", "experiment_name", "experiment")
_LINESTYLES = ("-", "--", ":", "-.")
_QUADRANT_COLORS = {"pos_high": "tab:red", "pos_low": "tab:orange", "neg_high": "tab:blue", "neg_low": "tab:cyan"}


# --------------------------------------------------------------------------------------------- loading


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


# Columns the figures and diagnoses read; a summary keeps these only (pooled validation metrics; maj@n per benchmark).
_PLOTTED = re.compile(
    r"(train/(entropy(/.*)?|stare/.*|reward/mean|response_length/mean|distinct_correct|quadrant/.*|grad_norm|"
    r"reflection/.*|frac_zero_std_groups|time/step_s|memory/.*)"
    r"|val/(avg@\w+|pass@\w+|[^/]+/maj@\w+|distinct_correct|response_length/mean|reflection/per_response))"
)


def write_summary(run_dir: str | os.PathLike, out_dir: str | os.PathLike, name: str | None = None) -> Path:
    """A small copy of a run for committing beside a notebook: one row per step, the plotted columns only,
    values to 6 significant digits, and ``hparams.yaml`` holding the run's name, seed and algorithm settings
    (what ``stare_lightning.compare`` groups runs by). Returns ``out_dir``."""
    import yaml

    df = load_run(run_dir)
    logged = yaml.safe_load(hparams.read_text()) if (hparams := Path(run_dir) / "hparams.yaml").is_file() else {}
    kept = {key: logged[key] for key in ("seed", "algorithm") if key in (logged or {})}
    keep = [c for c in df.columns if _PLOTTED.fullmatch(c) and df[c].notna().any()]
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    df[keep].to_csv(out_dir / METRICS_FILE, float_format="%.6g")
    (out_dir / "hparams.yaml").write_text(yaml.safe_dump({"run_name": name or df.attrs["name"], **kept}))
    return out_dir


def sweep_run_label(job_logs: Path) -> str:
    """``<algorithm>[_adaptive]_seed<seed>`` from a fit's logged hyper-parameters."""
    import yaml

    from stare_lightning.compare import arm_label

    logged = yaml.safe_load((job_logs / "hparams.yaml").read_text()) or {}
    return f"{arm_label(logged, job_logs.parent.name)}_seed{logged.get('seed', 0)}"


def summarize_sweep(sweep_dir: str | os.PathLike, out_dir: str | os.PathLike) -> list[Path]:
    """``write_summary`` of every fit under ``sweep_dir`` into ``out_dir/<label>`` (``sweep_run_label``)."""
    jobs = sorted(p.parent for p in Path(sweep_dir).rglob(f"logs/{METRICS_FILE}"))
    if not jobs:
        raise FileNotFoundError(f"no runs (*/logs/{METRICS_FILE}) under {sweep_dir}")
    return [write_summary(job, Path(out_dir) / sweep_run_label(job), sweep_run_label(job)) for job in jobs]


# -------------------------------------------------------------------------------------------- plotting


def _series(df: pd.DataFrame, column: str, smooth: int = 1) -> pd.Series | None:
    if column not in df.columns:
        return None
    s = df[column].dropna()
    if s.empty:
        return None
    if smooth > 1:
        s = s.rolling(smooth, min_periods=1).mean()
    return s


def _first_column(df: pd.DataFrame, candidates: Sequence[str]) -> str | None:
    for c in candidates:
        if c in df.columns and df[c].notna().any():
            return c
    return None


def _finish(ax: Axes, title: str, drew: bool, ylabel: str | None = None) -> None:
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("step", fontsize=8)
    if ylabel:
        ax.set_ylabel(ylabel, fontsize=8)
    ax.tick_params(labelsize=7)
    ax.grid(alpha=0.3)
    if not drew:
        ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes, color="gray")


def _run_colors(runs: Mapping[str, pd.DataFrame]) -> dict[str, str]:
    return {name: f"C{i % 10}" for i, name in enumerate(runs)}


def _plot_one_per_run(ax, runs, colors, candidates, title, smooth=1, ylabel=None, **style) -> None:
    drew = False
    for name, df in runs.items():
        column = _first_column(df, candidates)
        s = _series(df, column, smooth) if column else None
        if s is not None:
            ax.plot(s.index, s.values, color=colors[name], label=name, **style)
            drew = True
    _finish(ax, title, drew, ylabel)


def _plot_accuracy(ax, runs, colors, pattern: str, title: str) -> None:
    drew = False
    for name, df in runs.items():
        columns = sorted(
            (c for c in df.columns if re.fullmatch(pattern, c)),
            key=lambda c: (len(c), c),
        )
        for j, column in enumerate(columns):
            s = _series(df, column)
            if s is None:
                continue
            label = f"{name} {column.split('/')[-1]}"
            ax.plot(s.index, s.values, color=colors[name], linestyle=_LINESTYLES[j % 4], marker=".", label=label)
            drew = True
    _finish(ax, title, drew)
    if drew:
        ax.legend(fontsize=6)


def _plot_forecast(ax, runs, colors, prefix: str, smooth: int) -> None:
    """Entropy change per step: on the same batch (realised and first-order, one scale) where it was measured
    (``telemetry.same_batch_entropy``), else next batch minus this one against the nominal-lr forecast, the
    forecast on its own axis (its scale is nominal: only its sign and correlation carry information)."""
    same_batch = any(_series(df, f"{prefix}entropy/first_order_delta") is not None for df in runs.values())
    solid, dashed = (
        ("realized_delta_same_batch", "first_order_delta") if same_batch else ("realized_delta", "predicted_delta")
    )
    dashed_ax = ax if same_batch else ax.twinx()
    drew = False
    for name, df in runs.items():
        real = _series(df, f"{prefix}entropy/{solid}", smooth)
        other = _series(df, f"{prefix}entropy/{dashed}", smooth)
        if real is not None:
            ax.plot(real.index, real.values, color=colors[name], label=f"{name} realised")
            drew = True
        if other is not None:
            label = f"{name} first order" if same_batch else f"{name} predicted (right axis)"
            dashed_ax.plot(other.index, other.values, color=colors[name], linestyle="--", label=label)
            drew = True
    ax.axhline(0.0, color="black", linewidth=0.5)
    if same_batch:
        title = "entropy change of each update on its own batch:\nrealised (solid) vs first order (dashed)"
    else:
        title = "entropy change, next batch minus this one (solid)\nvs predicted at nominal lr (dashed, right axis)"
        corr = [
            f"{n}: {s.iloc[-1]:.2f}"
            for n, df in runs.items()
            if (s := _series(df, f"{prefix}entropy/forecast_corr")) is not None
        ]
        if corr:
            title += "; corr " + ", ".join(corr)
    _finish(ax, title, drew)
    if drew:
        handles, labels = ax.get_legend_handles_labels()
        if dashed_ax is not ax:
            more = dashed_ax.get_legend_handles_labels()
            handles, labels = handles + more[0], labels + more[1]
        ax.legend(handles, labels, fontsize=6)


def _plot_quadrants(ax, runs, definition: str, field: str, prefix: str, smooth: int) -> None:
    """Colour is the quadrant, line style is the run."""
    drew = False
    for r, df in enumerate(runs.values()):
        for quadrant in QUADRANTS:
            s = _series(df, f"{prefix}quadrant/{definition}/{quadrant}/{field}", smooth)
            if s is None:
                continue
            label = f"{quadrant}" if r == 0 else None
            ax.plot(s.index, s.values, color=_QUADRANT_COLORS[quadrant], linestyle=_LINESTYLES[r % 4], label=label)
            drew = True
    if field == "dH":
        ax.axhline(0.0, color="black", linewidth=0.5)
    _finish(ax, f"quadrant {definition} {field}", drew)
    if drew:
        ax.legend(fontsize=6)


def _run_style_note(runs: Mapping[str, pd.DataFrame]) -> str:
    return "line style per run: " + ", ".join(f"{name} '{_LINESTYLES[r % 4]}'" for r, name in enumerate(runs))


def plot_runs(
    runs: Mapping[str, pd.DataFrame], out_png: str | os.PathLike, prefix: str = "train/", smooth: int = 1
) -> Path:
    """Overview of several runs in one PNG: entropy, predicted vs realised change, exact-quadrant token
    share and dH, reflection words, val avg@n and val pass@k, reward and response length."""
    from matplotlib.figure import Figure

    colors = _run_colors(runs)
    fig = Figure(figsize=(16, 12), layout="constrained")
    ax = fig.subplots(3, 3)
    _plot_one_per_run(ax[0, 0], runs, colors, [f"{prefix}entropy", "entropy"], "entropy (token mean)", smooth)
    ax[0, 0].legend(fontsize=7)
    _plot_forecast(ax[0, 1], runs, colors, prefix, smooth)
    _plot_one_per_run(
        ax[0, 2],
        runs,
        colors,
        [f"{prefix}reflection/per_response", "val/reflection/per_response"],
        "reflection words per response",
        smooth,
    )
    _plot_quadrants(ax[1, 0], runs, "exact", "tokens", prefix, smooth)
    _plot_quadrants(ax[1, 1], runs, "exact", "dH", prefix, smooth)
    _plot_one_per_run(
        ax[1, 2],
        runs,
        colors,
        [f"{prefix}stare/gate_on"],
        "STARE gate on (fraction of steps)",
        smooth,
        drawstyle="steps-post",
    )
    _plot_accuracy(ax[2, 0], runs, colors, r"val/avg@\w+", "val avg@n")
    _plot_accuracy(ax[2, 1], runs, colors, r"val/pass@\w+", "val pass@k")
    _plot_one_per_run(
        ax[2, 2],
        runs,
        colors,
        [f"{prefix}reward/mean", f"{prefix}response_length/mean"],
        "reward mean (or response length)",
        smooth,
    )
    fig.suptitle(f"{' vs '.join(runs) or 'no runs'}   ({_run_style_note(runs)} in quadrant panels)", fontsize=10)
    return _save(fig, out_png)


def plot_quadrant_mass(
    runs: Mapping[str, pd.DataFrame], out_png: str | os.PathLike, prefix: str = "train/", smooth: int = 1
) -> Path:
    """Quadrant mass in detail: rows token share, weight share, dH; columns proxy, exact."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 11), layout="constrained")
    ax = fig.subplots(3, 2)
    for col, definition in enumerate(("proxy", "exact")):
        for row, field in enumerate(("tokens", "weight", "dH")):
            _plot_quadrants(ax[row, col], runs, definition, field, prefix, smooth)
    fig.suptitle(_run_style_note(runs), fontsize=10)
    return _save(fig, out_png)


def plot_reflection_words(
    runs: Mapping[str, pd.DataFrame],
    out_png: str | os.PathLike,
    prefix: str = "train/",
    smooth: int = 1,
    top: int = 8,
) -> Path:
    """One panel per run: mean count per response of its ``top`` most frequent reflection words."""
    from matplotlib.figure import Figure

    n = max(len(runs), 1)
    cols = min(n, 3)
    rows = math.ceil(n / cols)
    fig = Figure(figsize=(5.5 * cols, 4 * rows), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    start = f"{prefix}reflection/"
    for ax, (name, df) in zip(axes, runs.items()):
        words = [c for c in df.columns if c.startswith(start) and c != f"{start}per_response"]
        words = sorted(words, key=lambda c: -float(df[c].fillna(0).mean()))[:top]
        drew = False
        for j, column in enumerate(words):
            s = _series(df, column, smooth)
            if s is not None:
                ax.plot(s.index, s.values, color=f"C{j % 10}", label=column[len(start) :])
                drew = True
        _finish(ax, f"{name}: reflection words per response", drew)
        if drew:
            ax.legend(fontsize=6)
    for ax in axes[len(runs) :]:
        ax.set_visible(False)
    return _save(fig, out_png)


def plot_all(
    runs: Mapping[str, pd.DataFrame], out_dir: str | os.PathLike, prefix: str = "train/", smooth: int = 1
) -> list[Path]:
    """All figures into ``out_dir``: overview.png, quadrant_mass.png, reflection_words.png."""
    out_dir = Path(out_dir)
    return [
        plot_runs(runs, out_dir / "overview.png", prefix, smooth),
        plot_quadrant_mass(runs, out_dir / "quadrant_mass.png", prefix, smooth),
        plot_reflection_words(runs, out_dir / "reflection_words.png", prefix, smooth),
    ]


def _save(fig, out_png: str | os.PathLike) -> Path:
    out = Path(out_png)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    return out


if __name__ == "__main__":  # python -m stare_lightning.metrics.plots summarize <sweep dir> <out dir>
    import sys

    if len(sys.argv) != 4 or sys.argv[1] != "summarize":
        raise SystemExit("usage: python -m stare_lightning.metrics.plots summarize <sweep dir> <out dir>")
    for path in summarize_sweep(sys.argv[2], sys.argv[3]):
        print(path)
