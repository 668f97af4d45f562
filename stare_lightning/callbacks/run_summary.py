"""The end-of-fit report: a table of what moved (accuracy, diversity, entropy, gate, quadrants) and a PNG.

The table fits a terminal of 80 columns: each metric keeps its full name in a column of its own, and what "start" and
"end" mean is said once per section instead of on every row.
"""

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
STEP_TIME = "train/time/step_s"
# The step's phases: the timer's, and the wait for an asynchronous producer's batch.
STEP_PHASES = (*PHASES, "trainer_idle")
# With rollout.max_staleness >= 1: how old the samples were and where the producer spent its time.
ASYNC_KEYS = (
    "train/async/staleness/mean",
    "train/async/queue_depth",
    "train/time/engine_idle",
    "train/time/weight_push",
)
VAL_HEADING = "validation: first and last evaluation"
WINDOW = 10  # training steps averaged at each end of a run
TRAIN_HEADING = f"training: mean of the first and last {WINDOW} steps"


def train_window(steps: int) -> int:
    """Steps averaged at each end: ``WINDOW``, or half of a run shorter than twice that, so that the two ends never
    share a step (a 1-step run's both ends are its one step)."""
    return max(1, min(WINDOW, steps // 2))


def train_heading(steps: int) -> str:
    """The training section's heading, which says the window wherever it is not the usual one."""
    if steps >= 2 * WINDOW:
        return TRAIN_HEADING
    if steps < 2:
        return "training: the run's only step (start and end are the same)"
    window = train_window(steps)
    return f"training: mean of the first and last {window} of {steps} steps (a short run: half of it at each end)"


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

    def sections(self) -> list[tuple[str, list[tuple[str, str, str]]]]:
        """The table's sections: (heading, [(metric, start, end), ...]), empty sections left out."""
        val_rows = []
        first, last = (self.validations[0], self.validations[-1]) if self.validations else ({}, {})
        # Per-benchmark accuracy (val/<benchmark>/avg@<n>, maj@<n>) and their mean over benchmarks (val/avg).
        benchmarks = sorted(k for k in {*first, *last} if _BENCHMARK_KEY.fullmatch(k))
        for key in (*VAL_KEYS, *benchmarks, "val/avg"):
            if key in first or key in last:
                val_rows.append((key, _fmt(first.get(key)), _fmt(last.get(key))))
        train_rows = []
        window = train_window(len(self.train_history))
        head, tail = self.train_history[:window], self.train_history[-window:]
        quadrants = tuple(f"train/quadrant/exact/{quadrant}/tokens" for quadrant in QUADRANTS)
        for key in (*TRAIN_KEYS, *quadrants):
            start, end = _mean(head, key), _mean(tail, key)
            if start is not None or end is not None:
                train_rows.append((key, _fmt(start), _fmt(end)))
        train_rows += _time_rows(head, tail)
        if any((h.get("train/async/staleness/max") or 0) > 0 for h in self.train_history):
            train_rows += [(key, _fmt(_mean(head, key), 2), _fmt(_mean(tail, key), 2)) for key in ASYNC_KEYS]
        sections = [(VAL_HEADING, val_rows), (train_heading(len(self.train_history)), train_rows)]
        return [(heading, rows) for heading, rows in sections if rows]

    def rows(self) -> list[tuple[str, str, str]]:
        """(metric, at start, at end) rows of the table, every section's in order."""
        return [row for _, rows in self.sections() for row in rows]

    def table(self, steps: int):
        """The summary as a rich ``Table``: full metric names in the first column (a name longer than the terminal
        allows folds onto a second line instead of being cut), the numbers right-aligned."""
        from rich.table import Table
        from rich.text import Text

        table = Table(title=f"stare_lightning: {self.name} after {steps} steps")
        table.add_column("metric", overflow="fold")
        for column in ("start", "end"):
            table.add_column(column, justify="right", no_wrap=True)
        for heading, rows in self.sections():
            table.add_row(Text(heading, style="bold"), "", "")
            for index, (metric, start, end) in enumerate(rows):
                # A phase of the step time is indented under train/time/step_s, whose sum it is part of.
                phase = metric.removeprefix("train/time/") in STEP_PHASES
                label = f"  {metric}" if phase else metric
                table.add_row(label, start, end, end_section=index == len(rows) - 1)
        return table

    def teardown(self, trainer: lightning.Trainer, pl_module, stage: str) -> None:
        # At teardown, after the progress bar (earlier in the callback list) has stopped: the table comes last.
        if stage != "fit" or trainer.global_rank != 0 or trainer.sanity_checking:
            return
        from rich.console import Console

        console = Console()
        console.print(self.table(trainer.global_step))
        png = self.write_png(trainer)
        if png is not None:
            console.print(f"curves: {png}")

    def write_png(self, trainer: lightning.Trainer) -> Path | None:
        from lightning.pytorch.loggers import CSVLogger

        csv_dirs = [Path(lg.log_dir) for lg in trainer.loggers if isinstance(lg, CSVLogger)]
        if not csv_dirs or not (csv_dirs[0] / "metrics.csv").is_file():
            return None
        from stare_lightning.analysis.plots import plot_runs
        from stare_lightning.analysis.runs import load_run

        out = Path(trainer.default_root_dir) / self.png_name
        plot_runs({Path(trainer.default_root_dir).name: load_run(csv_dirs[0])}, out)
        return out

    def state_dict(self) -> dict:
        return {"validations": self.validations, "train_history": self.train_history}

    def load_state_dict(self, state_dict: dict) -> None:
        self.validations = list(state_dict.get("validations", []))
        self.train_history = list(state_dict.get("train_history", []))


def _time_rows(head: list[dict[str, float]], tail: list[dict[str, float]]) -> list[tuple[str, str, str]]:
    """The step time, then each phase that took time (the tool's only with a tool); the phases add up to it."""
    if _mean(head, STEP_TIME) is None and _mean(tail, STEP_TIME) is None:
        return []
    ran = [p for p in STEP_PHASES if any((_mean(h, f"train/time/{p}") or 0.0) > 0 for h in (head, tail))]
    keys = [STEP_TIME, *(f"train/time/{phase}" for phase in ran)]
    return [(key, _fmt(_mean(head, key), 2), _fmt(_mean(tail, key), 2)) for key in keys]


def _mean(history: list[dict[str, float]], key: str) -> float | None:
    values = [h[key] for h in history if key in h and math.isfinite(h[key])]
    return sum(values) / len(values) if values else None


def _fmt(value: float | None, digits: int = 4) -> str:
    return "-" if value is None else f"{value:.{digits}f}"
