"""Figures of several finished runs side by side (frames from ``runs.load_runs``): the entropy story.

Not from the paper; the panels follow the telemetry of docs/method.md, section 5: entropy, predicted vs
realised entropy change, quadrant mass (token share, weight share, dH), reflection words, and accuracy
(val avg@n, val pass@k). Works on whatever subset of columns a run logged (a missing metric leaves its panel
marked "not logged"). matplotlib's object API (no pyplot state): headless, callable right after a fit.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from stare_lightning.metrics.functional import QUADRANTS

if TYPE_CHECKING:
    import pandas as pd
    from matplotlib.axes import Axes

_LINESTYLES = ("-", "--", ":", "-.")
_QUADRANT_COLORS = {"pos_high": "tab:red", "pos_low": "tab:orange", "neg_high": "tab:blue", "neg_low": "tab:cyan"}


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
    share and dH, reflection words, val avg@n and val pass@k, reward and response length; with asynchronous
    rollouts (``rollout.max_staleness`` >= 1) a fourth row: the samples' staleness, the trainer's and the producer's
    idle time."""
    from matplotlib.figure import Figure

    colors = _run_colors(runs)
    staleness = f"{prefix}async/staleness/mean"
    asynchronous = any(staleness in df and df[staleness].max() > 0 for df in runs.values())
    fig = Figure(figsize=(16, 16 if asynchronous else 12), layout="constrained")
    ax = fig.subplots(4 if asynchronous else 3, 3)
    if asynchronous:
        _plot_one_per_run(ax[3, 0], runs, colors, [staleness], "sample staleness (policy versions)", smooth)
        _plot_one_per_run(ax[3, 1], runs, colors, [f"{prefix}time/trainer_idle"], "trainer idle (s per step)", smooth)
        _plot_one_per_run(ax[3, 2], runs, colors, [f"{prefix}time/engine_idle"], "producer idle (s per batch)", smooth)
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
