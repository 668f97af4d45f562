"""The end-of-fit summary table on an 80-column terminal: every metric name whole, no line wider than the terminal."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from stare_lightning.callbacks import RunSummary
from stare_lightning.metrics.functional import QUADRANTS
from stare_lightning.metrics.step_timer import PHASES

WIDTH = 80


def summary_with_every_row(benchmark: str = "olympiadbench") -> RunSummary:
    """A summary holding every row the table can show, with wide values (a five-digit throughput)."""
    summary = RunSummary(name="stare_o1")
    val = {
        "val/avg@n": 0.25,
        "val/pass@1": 0.25,
        "val/distinct_correct": 1.5,
        "val/response_length/mean": 9.25,
        f"val/{benchmark}/avg@32": 0.125,
        f"val/{benchmark}/maj@32": 0.5,
        "val/avg": 0.125,
    }
    summary.validations = [val, {k: v + 0.5 for k, v in val.items()}]
    step = {
        "train/entropy": 0.47,
        "train/reward/mean": 0.3,
        "train/distinct_correct": 1.25,
        "train/stare/gate_on": 1.0,
        "train/stare/w": 3.0,
        "train/throughput/tokens_per_s": 12345.678,
        "train/memory/peak_gib": 12.5,
        "train/memory/current_gib": 12.25,
        "train/time/step_s": 123.45,
        **{f"train/time/{phase}": 1.0 for phase in PHASES},
        **{f"train/quadrant/exact/{q}/tokens": 0.25 for q in QUADRANTS},
    }
    summary.train_history = [dict(step) for _ in range(12)]
    return summary


def rendered(summary: RunSummary, width: int = WIDTH) -> list[str]:
    out = io.StringIO()
    Console(file=out, width=width, color_system=None, legacy_windows=False).print(summary.table(300))
    return out.getvalue().splitlines()


def test_every_row_fits_80_columns_with_its_whole_name():
    summary = summary_with_every_row()
    lines = rendered(summary)
    assert max(len(line) for line in lines) <= WIDTH, "\n".join(lines)
    text = "\n".join(lines)
    assert "…" not in text, text  # rich's mark of a cut cell
    names = [metric for metric, _, _ in summary.rows()]
    assert len(names) == 7 + 8 + len(QUADRANTS) + 1 + len(PHASES)
    for name in names:  # each name whole, on one line, in the metric column
        assert any(f"│ {name} " in line or f"│   {name} " in line for line in lines), f"{name} cut:\n{text}"
    for value in ("12345.6780", "123.45", "0.7500"):
        assert value in text


@pytest.mark.parametrize("width", [60, WIDTH])
def test_a_name_wider_than_the_terminal_folds_onto_a_second_line_instead_of_being_cut(width):
    benchmark = "a_benchmark_file_stem_of_a_length_that_no_terminal_column_holds_v2"
    lines = rendered(summary_with_every_row(benchmark), width)
    assert max(len(line) for line in lines) <= width
    cells = [line.split("│")[1].strip() for line in lines if line.startswith("│")]
    joined = "".join(cells)  # the folded pieces, read in order, give the name back
    assert f"val/{benchmark}/avg@32" in joined and "…" not in "\n".join(lines)
