"""``python -m stare_lightning.analysis.compare <runs> [--table CSV] [--baseline ARM]``: seed statistics and one PNG.

A directory of runs (a Hydra ``-m`` sweep, several sweeps side by side, or the small summaries committed
beside a notebook) is read as arms x seeds. A run's arm is its algorithm's name (``_adaptive`` added for
STARE's adaptive schedule), prefixed by the sweep folder it sits in when the directory holds several sweeps.
For every arm and outcome the table gives the mean and sample standard deviation over seeds, and against the
baseline arm (GRPO-ds when present) the mean of the paired differences (same seed, same prompts) with its 95%
Student-t interval. Outcomes:
- ``entropy``, ``distinct_correct``: training means over the last ``tail`` logged steps;
- ``val_avg@n``, ``val_pass@<k>``: the mean of the last ``val_tail`` validations (3: steps 200-300 of the
  offline default), which halves the noise of one 64-problem evaluation.
The PNG draws training entropy, distinct correct answers (smoothed) and validation accuracy, one line per run.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from pathlib import Path

import yaml

from stare_lightning.analysis.runs import arm_label, load_run
from stare_lightning.analysis.student_t import t_quantile_975

__all__ = ["Run", "compare", "find_runs", "markdown_table", "run_outcomes", "seed_statistics"]

DEFAULT_BASELINE = "grpo_ds"


@dataclass(frozen=True)
class Run:
    arm: str
    seed: int
    logs: Path  # the folder holding metrics.csv and hparams.yaml


def find_runs(root: str | Path) -> list[Run]:
    """Every run under ``root`` (a ``metrics.csv`` beside a ``hparams.yaml``) with its arm and seed."""
    root = Path(root)
    found = []
    for metrics in sorted(root.rglob("metrics.csv")):
        logs = metrics.parent
        hparams = yaml.safe_load((logs / "hparams.yaml").read_text()) if (logs / "hparams.yaml").is_file() else {}
        job = logs.parent if logs.name == "logs" else logs  # a fit's job folder, or a summary's folder
        algorithm = arm_label(hparams, job.name)
        found.append((job.parent.relative_to(root).parts, algorithm, int((hparams or {}).get("seed", 0)), logs))
    if not found:
        raise FileNotFoundError(f"no runs (metrics.csv with hparams.yaml) under {root}")
    several_sweeps = len({sweep for sweep, *_ in found}) > 1

    def arm(sweep: tuple[str, ...], algorithm: str) -> str:
        # A study laid out as <arm>/seed<k> names each folder after its arm: the folder adds nothing.
        return "/".join([*sweep, algorithm]) if several_sweeps and sweep != (algorithm,) else algorithm

    return [Run(arm(sweep, algorithm), seed, logs) for sweep, algorithm, seed, logs in found]


def run_outcomes(logs: Path, tail: int = 50, val_tail: int = 3) -> dict[str, float]:
    """The outcomes of one run (module docstring); an outcome its logs lack is left out."""
    frame = load_run(logs)
    outcomes = {}
    for column, name in (("train/entropy", "entropy"), ("train/distinct_correct", "distinct_correct")):
        if column in frame:
            outcomes[name] = float(frame[column].dropna().tail(tail).mean())
    for column in sorted(c for c in frame.columns if c == "val/avg@n" or c.startswith("val/pass@")):
        values = frame[column].dropna()
        if not values.empty:
            outcomes[column.replace("/", "_")] = float(values.tail(val_tail).mean())
    return outcomes


def _mean_sd(values: list[float]) -> tuple[float, float]:
    mean = sum(values) / len(values)
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1)) if len(values) > 1 else math.nan
    return mean, sd


def seed_statistics(runs: list[Run], baseline: str | None = None, tail: int = 50, val_tail: int = 3):
    """One row per (arm, outcome): seeds, mean, sd, and the paired difference to ``baseline`` with its 95% interval.

    ``baseline``: an arm name, or the one ending in ``grpo_ds`` when None (no paired columns without one).
    Pairs are the seeds both arms ran; the interval needs two of them. ``tail`` and ``val_tail`` are the windows of
    ``run_outcomes`` (``val_tail=1``: the final validation alone).
    """
    import pandas as pd

    outcomes = {(run.arm, run.seed): run_outcomes(run.logs, tail, val_tail) for run in runs}
    arms = sorted({run.arm for run in runs})
    if baseline is None:
        baseline = next((arm for arm in arms if arm.split("/")[-1] == DEFAULT_BASELINE), None)
    elif baseline not in arms:
        raise ValueError(f"baseline={baseline!r} is not one of the arms found: {arms}")
    rows = []
    for arm in arms:
        seeds = sorted(seed for a, seed in outcomes if a == arm)
        names = sorted({name for seed in seeds for name in outcomes[arm, seed]})
        for name in names:
            values = [outcomes[arm, seed][name] for seed in seeds if name in outcomes[arm, seed]]
            mean, sd = _mean_sd(values)
            row = {"arm": arm, "outcome": name, "seeds": len(values), "mean": mean, "sd": sd}
            if baseline is not None and arm != baseline:
                row.update(_paired(outcomes, arm, baseline, name))
            rows.append(row)
    return pd.DataFrame(rows)


def _paired(outcomes: dict, arm: str, baseline: str, name: str) -> dict[str, float]:
    seeds = sorted(
        s for a, s in outcomes if a == arm and name in outcomes[arm, s] and name in outcomes.get((baseline, s), {})
    )
    diffs = [outcomes[arm, s][name] - outcomes[baseline, s][name] for s in seeds]
    if len(diffs) < 2:
        return {"pairs": len(diffs), "diff": diffs[0] if diffs else math.nan, "diff_lo": math.nan, "diff_hi": math.nan}
    mean, sd = _mean_sd(diffs)
    half = t_quantile_975(len(diffs) - 1) * sd / math.sqrt(len(diffs))
    return {"pairs": len(diffs), "diff": mean, "diff_lo": mean - half, "diff_hi": mean + half}


def markdown_table(stats) -> str:
    """``mean +- sd`` per arm and outcome, and the paired difference ``d [lo, hi]`` where there is one."""
    lines = [
        "| arm | outcome | seeds | mean +- sd | paired difference to baseline [95% interval] |",
        "|---|---|---|---|---|",
    ]
    for row in stats.to_dict("records"):
        diff = row.get("diff")
        paired = "" if diff is None or math.isnan(diff) else f"{diff:+.3f}"
        if paired and not math.isnan(row.get("diff_lo", math.nan)):
            paired += f" [{row['diff_lo']:+.3f}, {row['diff_hi']:+.3f}]"
        spread = f"{row['mean']:.3f} +- {row['sd']:.3f}"
        lines.append(f"| {row['arm']} | {row['outcome']} | {row['seeds']} | {spread} | {paired} |")
    return "\n".join(lines)


def compare(sweep_dir: str | Path, out_png: str | Path | None = None, smooth: int = 10) -> Path:
    """One PNG of every run under ``sweep_dir``: entropy, distinct correct answers and validation accuracy."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    sweep_dir = Path(sweep_dir)
    runs = find_runs(sweep_dir)
    figure = Figure(figsize=(15, 4.2), layout="constrained")
    axes = figure.subplots(1, 3)
    panels = [
        ("train/entropy", "entropy (nats/token)", 1),
        ("train/distinct_correct", f"distinct correct per prompt (train, {smooth}-step mean)", smooth),
        ("val/avg@n", "validation accuracy (avg@n)", 1),
    ]
    for run in runs:
        frame = load_run(run.logs)
        for ax, (column, title, window) in zip(axes, panels):
            if column in frame:
                series = frame[column].dropna()
                ax.plot(
                    series.index,
                    series.rolling(window, min_periods=1).mean(),
                    label=f"{run.arm} (seed {run.seed})",
                    marker="o" if column.startswith("val/") else None,
                )
            ax.set_title(title)
            ax.set_xlabel("step")
    axes[0].legend(fontsize=7)
    out = Path(out_png) if out_png else sweep_dir / "comparison.png"
    figure.savefig(out, dpi=110)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m stare_lightning.analysis.compare", description=__doc__.splitlines()[0]
    )
    parser.add_argument("runs", help="a sweep directory, a folder of sweeps, or a folder of run summaries")
    parser.add_argument("--table", help="also write the seed statistics to this CSV file")
    parser.add_argument(
        "--baseline", help=f"the arm the paired differences are taken to (default: *{DEFAULT_BASELINE})"
    )
    parser.add_argument("--tail", type=int, default=50, help="training outcomes: mean over this many last steps")
    parser.add_argument(
        "--val-tail", type=int, default=3, help="validation outcomes: mean over this many last validations"
    )
    args = parser.parse_args(argv)
    stats = seed_statistics(find_runs(args.runs), args.baseline, args.tail, args.val_tail)
    print(markdown_table(stats))
    if args.table:
        Path(args.table).parent.mkdir(parents=True, exist_ok=True)
        stats.to_csv(args.table, index=False, float_format="%.6g")
        print(f"table: {args.table}")
    print(f"comparison: {compare(args.runs)}")


if __name__ == "__main__":
    main()
