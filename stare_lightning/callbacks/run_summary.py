"""The end-of-fit report: a table of what moved (accuracy, diversity, entropy, gate, quadrants) and a PNG."""

from __future__ import annotations

import math
import re
from pathlib import Path

import lightning
from lightning.pytorch.callbacks import Callback

from stare_lightning.metrics.functional import QUADRANTS
from stare_lightning.metrics.step_timer import PHASES

_BENCHMARK_KEY = re.compile(r"val/[^/]+/(avg|maj)@\d+")
VAL_KEYS = ("val/avg@n", "val/pass@1", "val/distinct_correct", "val/response_length/mean")
TRAIN_KEYS = (
    "train/entropy",
    "train/reward/mean",
    "train/distinct_correct",
    "train/stare/gate_on",
    "train/stare/w",
    "train/throughput/tokens_per_s",
    "train/memory/peak_gib",
    "train/memory/current_gib",
)


class RunSummary(Callback):
    """Collects validation results (the first one is the starting policy) and per-step training metrics.

    ``name``: what the table's title calls the run (the algorithm's name in ``fit``).
    """

    def __init__(self, name: str = "run", png_name: str = "curves.png") -> None:
        self.name = name
        self.png_name = png_name
        self.validations: list[dict[str, float]] = []
        self.train_history: list[dict[str, float]] = []

    def on_validation_end(self, trainer: lightning.Trainer, pl_module) -> None:
        if trainer.sanity_checking:
            return
        values = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/")}
        if values:
            self.validations.append(values)

    def on_train_batch_end(self, trainer: lightning.Trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        self.train_history.append({k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("train/")})

    def rows(self) -> list[tuple[str, str, str]]:
        """(metric, at start, at end) rows of the table."""
        rows = []
        first, last = (self.validations[0], self.validations[-1]) if self.validations else ({}, {})
        # Per-benchmark accuracy (val/<benchmark>/avg@<n>, maj@<n>) and their mean over benchmarks (val/avg).
        benchmarks = sorted(k for k in {*first, *last} if _BENCHMARK_KEY.fullmatch(k))
        for key in (*VAL_KEYS, *benchmarks, "val/avg"):
            if key in first or key in last:
                rows.append((key, _fmt(first.get(key)), _fmt(last.get(key))))
        head, tail = self.train_history[:10], self.train_history[-10:]
        for key in TRAIN_KEYS:
            start, end = _mean(head, key), _mean(tail, key)
            if start is not None or end is not None:
                rows.append((key + " (first/last 10 steps)", _fmt(start), _fmt(end)))
        time_row = _time_row(head, tail)
        if time_row is not None:
            rows.append(time_row)
        for quadrant in QUADRANTS:
            key = f"train/quadrant/exact/{quadrant}/tokens"
            start, end = _mean(head, key), _mean(tail, key)
            if start is not None:
                rows.append((key, _fmt(start), _fmt(end)))
        return rows

    def teardown(self, trainer: lightning.Trainer, pl_module, stage: str) -> None:
        # At teardown, after the progress bar (earlier in the callback list) has stopped: the table comes last.
        if stage != "fit" or trainer.global_rank != 0 or trainer.sanity_checking:
            return
        from rich.console import Console
        from rich.table import Table

        table = Table(title=f"stare_lightning: {self.name} after {trainer.global_step} steps")
        for column in ("metric", "start", "end"):
            table.add_column(column)
        for row in self.rows():
            table.add_row(*row)
        console = Console()
        console.print(table)
        png = self.write_png(trainer)
        if png is not None:
            console.print(f"curves: {png}")

    def write_png(self, trainer: lightning.Trainer) -> Path | None:
        from lightning.pytorch.loggers import CSVLogger

        csv_dirs = [Path(lg.log_dir) for lg in trainer.loggers if isinstance(lg, CSVLogger)]
        if not csv_dirs or not (csv_dirs[0] / "metrics.csv").is_file():
            return None
        from stare_lightning.metrics.plots import load_run, plot_runs

        out = Path(trainer.default_root_dir) / self.png_name
        plot_runs({Path(trainer.default_root_dir).name: load_run(csv_dirs[0])}, out)
        return out

    def state_dict(self) -> dict:
        return {"validations": self.validations, "train_history": self.train_history}

    def load_state_dict(self, state_dict: dict) -> None:
        self.validations = list(state_dict.get("validations", []))
        self.train_history = list(state_dict.get("train_history", []))


def _time_row(head: list[dict[str, float]], tail: list[dict[str, float]]) -> tuple[str, str, str] | None:
    """The step time and its phases folded into one row, ``0.75 = 0.38 + 0.02 + ...``; phases that never took
    time (the tool's without a tool) are left out."""
    if _mean(head, "train/time/step_s") is None and _mean(tail, "train/time/step_s") is None:
        return None
    ran = [p for p in PHASES if any((_mean(h, f"train/time/{p}") or 0.0) > 0 for h in (head, tail))]

    def folded(history):
        total = _fmt(_mean(history, "train/time/step_s"), 2)
        parts = [_fmt(_mean(history, f"train/time/{phase}"), 2) for phase in ran]
        return f"{total} = {' + '.join(parts)}" if parts else total

    return f"train/time/step_s = {' + '.join(ran)} (first/last 10 steps)", folded(head), folded(tail)


def _mean(history: list[dict[str, float]], key: str) -> float | None:
    values = [h[key] for h in history if key in h and math.isfinite(h[key])]
    return sum(values) / len(values) if values else None


def _fmt(value: float | None, digits: int = 4) -> str:
    return "-" if value is None else f"{value:.{digits}f}"
