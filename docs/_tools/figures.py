"""The site's and the README's figures, from committed data only: run logs under notebooks/data and the images the
committed, executed notebooks hold. Nothing is trained or re-executed.

    python docs/_tools/figures.py     # writes docs/assets/figures/*.png

Run it again after a study's data or notebook changes; the PNGs are committed so that the README shows its figure
where the site is not built.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import pandas as pd  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "notebooks" / "data"
OUT = REPO / "docs" / "assets" / "figures"
COLORS = {"grpo_ds": "C0", "stare_o1": "C1"}
LABELS = {"grpo_ds": "GRPO-ds", "stare_o1": "STARE-O1"}

# (notebook, index of the code cell among cells, index of the image in that cell's outputs) -> file name
NOTEBOOK_IMAGES = {
    ("async_study.ipynb", 10, 0): "async_study_entropy.png",
    ("offline_headline.ipynb", 9, 0): "offline_headline_entropy.png",
    ("offline_headline.ipynb", 11, 0): "offline_headline_accuracy.png",
    ("offline_tradeoff.ipynb", 5, 0): "offline_tradeoff.png",
    ("selector_ablation.ipynb", 8, 0): "selector_ablation_entropy.png",
    ("selector_ablation.ipynb", 10, 0): "selector_ablation_mechanism.png",
    ("smollm2_study.ipynb", 3, 0): "smollm2_study.png",
    ("smollm2_study.ipynb", 5, 0): "smollm2_pass_at_k.png",
    ("lora_study.ipynb", 3, 0): "lora_learning_rate.png",
    ("lora_study.ipynb", 5, 0): "lora_study.png",
    ("entropy_dynamics.ipynb", 7, 0): "telemetry_overview.png",
    ("entropy_dynamics.ipynb", 7, 1): "telemetry_quadrants.png",
}


def notebook_image(notebook: str, cell: int, index: int) -> bytes:
    """The ``index``-th PNG output of cell ``cell`` of a committed notebook."""
    cells = json.loads((REPO / "notebooks" / notebook).read_text())["cells"]
    images = [o["data"]["image/png"] for o in cells[cell].get("outputs", []) if "image/png" in o.get("data", {})]
    return base64.b64decode(images[index])


def train_column(csv: Path, column: str) -> pd.Series:
    frame = pd.read_csv(csv)
    rows = frame[frame[column].notna()]
    return rows.set_index("step")[column]


def entropy_figure(path: Path) -> None:
    """Training entropy of GRPO-ds and STARE-O1 (W = 3) in the offline default, seeds 1-10 (the README's figure)."""
    figure = Figure(figsize=(7.5, 3.6), layout="constrained")
    axes = figure.subplots()
    for arm in ("grpo_ds", "stare_o1"):
        seeds = [train_column(DATA / "offline_headline" / f"{arm}_seed{s}" / "metrics.csv", "train/entropy")
                 for s in range(1, 11)]  # fmt: skip
        frame = pd.concat(seeds, axis=1).rolling(10, min_periods=1).mean()
        mean = frame.mean(axis=1)
        axes.fill_between(frame.index, frame.min(axis=1), frame.max(axis=1), color=COLORS[arm], alpha=0.2, lw=0)
        axes.plot(mean.index, mean, color=COLORS[arm], label=f"{LABELS[arm]} (mean of seeds 1-10)")
    axes.axhline(0.3, color="0.4", ls=":", label="STARE's target entropy")
    axes.set(xlabel="training step", ylabel="entropy (nats per token)")
    axes.set_title("Offline default: the token entropy, 10-step mean (band: lowest to highest seed)", fontsize=10)
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8)
    figure.savefig(path, dpi=110)


def tool_use_figure(path: Path) -> None:
    """Entropy after a tool reply and elsewhere, GRPO-ds against STARE-O1 with the calculator, seeds 1 and 2."""
    figure = Figure(figsize=(9, 3.4), layout="constrained")
    panels = figure.subplots(1, 2, sharey=True)
    for axes, column, title in zip(
        panels,
        ("train/entropy/after_tool", "train/entropy/elsewhere"),
        ("first 8 policy tokens after a tool reply", "every other policy token"),
    ):
        for arm in ("grpo_ds", "stare_o1"):
            for seed, style in ((1, "-"), (2, "--")):
                csv = DATA / "tool_countdown" / arm / f"{arm}_seed{seed}" / "metrics.csv"
                series = train_column(csv, column).rolling(10, min_periods=1).mean()
                axes.plot(series.index, series, style, color=COLORS[arm], label=f"{LABELS[arm]}, seed {seed}")
        axes.set(title=f"entropy, {title}", xlabel="training step")
        axes.grid(alpha=0.3)
    panels[0].set_ylabel("nats per token (10-step mean)")
    panels[0].legend(fontsize=8)
    figure.savefig(path, dpi=110)


def performance_figure(path: Path) -> None:
    """Step time and memory of SmolLM2-135M's GRPO-ds runs on the 2-core CPU, step by step."""
    figure = Figure(figsize=(10, 3.6), layout="constrained")
    time_axes, memory_axes = figure.subplots(1, 2)
    length_axes = time_axes.twinx()
    cut, above = 60.0, []
    for seed, color in zip((0, 1, 2), ("C0", "C2", "C4")):
        csv = DATA / "smollm2_study" / f"grpo_ds_seed{seed}" / "metrics.csv"
        seconds = train_column(csv, "train/time/step_s")
        above += list(seconds[seconds > cut])
        time_axes.plot(seconds.clip(upper=cut), color=color, lw=1, label=f"step time, seed {seed}")
        length_axes.plot(train_column(csv, "train/response_length/mean"), color=color, lw=1, ls=":")
        memory_axes.plot(train_column(csv, "train/memory/peak_gib"), color=color, lw=1, label=f"peak, seed {seed}")
        memory_axes.plot(train_column(csv, "train/memory/current_gib"), color=color, lw=1, ls=":")
    time_axes.set_title(
        f"seconds per step (solid; {len(above)} steps above {cut:.0f} s, up to {max(above):.0f} s, drawn at "
        f"{cut:.0f})\nand mean response length in tokens (dotted, right axis)",
        fontsize=9,
    )
    time_axes.set(xlabel="training step", ylabel="s", ylim=(0, cut * 1.05))
    length_axes.set_ylabel("tokens")
    memory_axes.set_title("process memory, GiB: peak (solid), after the step (dotted)", fontsize=9)
    memory_axes.set(xlabel="training step")
    for axes in (time_axes, memory_axes):
        axes.grid(alpha=0.3)
        axes.legend(fontsize=7, loc="upper right")
    figure.suptitle("SmolLM2-135M-Instruct, GRPO-ds, experiment=smollm2_study, 2-core CPU", fontsize=10)
    figure.savefig(path, dpi=110)


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    for (notebook, cell, index), name in NOTEBOOK_IMAGES.items():
        (OUT / name).write_bytes(notebook_image(notebook, cell, index))
    entropy_figure(OUT / "entropy_grpo_vs_stare.png")
    tool_use_figure(OUT / "tool_use_entropy.png")
    performance_figure(OUT / "performance_smollm2.png")
    for path in sorted(OUT.glob("*.png")):
        print(path.relative_to(REPO), f"{path.stat().st_size // 1024} KiB")


if __name__ == "__main__":
    main()
