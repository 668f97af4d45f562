"""``python -m stare_lightning.compare <sweep dir>``: one PNG comparing the runs of a sweep.

Three panels: training entropy, distinct correct answers per prompt (training, smoothed) and validation
accuracy, one line per run, named by the run's algorithm (and seed when several seeds are present).
"""

from __future__ import annotations

import sys
from pathlib import Path

import yaml


def _label(job_dir: Path) -> str:
    hparams = job_dir / "logs" / "hparams.yaml"
    logged = (yaml.safe_load(hparams.read_text()) or {}) if hparams.is_file() else {}
    algorithm = logged.get("algorithm", {}).get("name", job_dir.name)
    return f"{algorithm} (seed {logged.get('seed', '?')})"


def compare(sweep_dir: str | Path, out_png: str | Path | None = None, smooth: int = 10) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    from stare_lightning.metrics.plots import load_run

    sweep_dir = Path(sweep_dir)
    jobs = sorted(p.parent.parent for p in sweep_dir.glob("*/logs/metrics.csv"))
    if not jobs:
        raise FileNotFoundError(f"no runs (*/logs/metrics.csv) under {sweep_dir}")
    figure = Figure(figsize=(15, 4.2), layout="constrained")
    axes = figure.subplots(1, 3)
    panels = [
        ("train/entropy", "entropy (nats/token)", 1),
        ("train/distinct_correct", f"distinct correct per prompt (train, {smooth}-step mean)", smooth),
        ("val/avg@n", "validation accuracy (avg@n)", 1),
    ]
    for job in jobs:
        frame, label = load_run(job / "logs"), _label(job)
        for ax, (column, title, window) in zip(axes, panels):
            if column in frame:
                series = frame[column].dropna()
                ax.plot(
                    series.index,
                    series.rolling(window, min_periods=1).mean(),
                    label=label,
                    marker="o" if column.startswith("val/") else None,
                )
            ax.set_title(title)
            ax.set_xlabel("step")
    axes[0].legend()
    out = Path(out_png) if out_png else sweep_dir / "comparison.png"
    figure.savefig(out, dpi=110)
    return out


def main() -> None:
    if len(sys.argv) != 2:
        raise SystemExit("usage: python -m stare_lightning.compare <sweep directory>")
    print(f"comparison: {compare(sys.argv[1])}")


if __name__ == "__main__":
    main()
