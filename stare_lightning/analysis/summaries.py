"""Small copies of finished runs for committing beside a notebook: one row per step, the plotted columns only.

``python -m stare_lightning.analysis.summaries <sweep dir> <out dir>`` writes one per fit of a Hydra sweep,
named ``<algorithm>[_adaptive]_seed<seed>``.
"""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path

from stare_lightning.analysis.runs import METRICS_FILE, arm_label, load_run

# Columns the figures and diagnoses read; a summary keeps these only (pooled validation metrics; maj@n per benchmark;
# with asynchronous rollouts the samples' staleness, the behaviour-to-current log-prob gap and where the time went;
# the entropy controllers' signals: the PI controller's, the adaptive bonus's coefficient, STARE's scheduled target).
_PLOTTED = re.compile(
    r"(train/(entropy(/.*)?|stare/.*|pi/.*|entropy_bonus/.*|reward/mean|response_length/mean|distinct_correct|"
    r"quadrant/.*|grad_norm|"
    r"reflection/.*|frac_zero_std_groups|time/.*|memory/.*|async/.*|rollout/logprob_abs_diff/.*)"
    r"|val/(avg@\w+|pass@\w+|[^/]+/maj@\w+|distinct_correct|response_length/mean|reflection/per_response))"
)


def write_summary(run_dir: str | os.PathLike, out_dir: str | os.PathLike, name: str | None = None) -> Path:
    """A small copy of a run for committing beside a notebook: one row per step, the plotted columns only,
    values to 6 significant digits, and ``hparams.yaml`` holding the run's name, seed, algorithm settings (what
    ``stare_lightning.analysis.compare`` groups runs by) and rollout settings. Returns ``out_dir``."""
    import yaml

    df = load_run(run_dir)
    logged = yaml.safe_load(hparams.read_text()) if (hparams := Path(run_dir) / "hparams.yaml").is_file() else {}
    kept = {key: logged[key] for key in ("seed", "algorithm", "rollout") if key in (logged or {})}
    keep = [c for c in df.columns if _PLOTTED.fullmatch(c) and df[c].notna().any()]
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    df[keep].to_csv(out_dir / METRICS_FILE, float_format="%.6g")
    (out_dir / "hparams.yaml").write_text(yaml.safe_dump({"run_name": name or df.attrs["name"], **kept}))
    return out_dir


def sweep_run_label(job_logs: Path) -> str:
    """``<algorithm>[_adaptive]_seed<seed>`` from a fit's logged hyper-parameters."""
    import yaml

    logged = yaml.safe_load((job_logs / "hparams.yaml").read_text()) or {}
    return f"{arm_label(logged, job_logs.parent.name)}_seed{logged.get('seed', 0)}"


def summarize_sweep(sweep_dir: str | os.PathLike, out_dir: str | os.PathLike) -> list[Path]:
    """``write_summary`` of every fit under ``sweep_dir`` into ``out_dir/<label>`` (``sweep_run_label``)."""
    jobs = sorted(p.parent for p in Path(sweep_dir).rglob(f"logs/{METRICS_FILE}"))
    if not jobs:
        raise FileNotFoundError(f"no runs (*/logs/{METRICS_FILE}) under {sweep_dir}")
    return [write_summary(job, Path(out_dir) / sweep_run_label(job), sweep_run_label(job)) for job in jobs]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m stare_lightning.analysis.summaries", description=__doc__.splitlines()[0]
    )
    parser.add_argument("sweep_dir", help="a Hydra sweep directory (fits with logs/metrics.csv)")
    parser.add_argument("out_dir", help="where the summaries go, one folder per fit")
    args = parser.parse_args(argv)
    for path in summarize_sweep(args.sweep_dir, args.out_dir):
        print(path)


if __name__ == "__main__":
    main()
