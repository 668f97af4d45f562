"""The entropy-dynamics notebook runs end to end on two fake CSVLogger runs and writes its PNGs; the
loader merges sparse rows per step and names runs from hparams.yaml or the folder."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from stare_lightning.metrics import QUADRANTS

REPO = Path(__file__).resolve().parents[1]
NOTEBOOK = REPO / "notebooks" / "entropy_dynamics.ipynb"
WORDS = ["wait", "however", "let_me_verify", "re-check"]


def write_fake_run(run_dir: Path, seed: int, steps: int = 30, name: str | None = None) -> Path:
    """A CSVLogger-like metrics.csv: train rows every step, val rows every 10 steps, sparse with NaN."""
    import pandas as pd

    rng = np.random.default_rng(seed)
    rows = []
    entropy = 0.6
    for step in range(steps):
        pred = float(rng.normal(-0.01, 0.005))
        entropy = max(0.01, entropy + pred + float(rng.normal(0, 0.003)))
        row = {
            "epoch": 0,
            "step": step,
            "train/entropy": entropy,
            "train/stare/gate_on": float(entropy < 0.3),
            "train/reward/mean": float(rng.uniform(0, 1)),
            "train/response_length/mean": float(rng.uniform(20, 80)),
        }
        if step > 0:
            row["train/entropy/predicted_delta"] = pred
            row["train/entropy/realized_delta"] = float(rng.normal(pred, 0.004))
        if step > 2:
            row["train/entropy/forecast_corr"] = float(rng.uniform(0.2, 0.9))
        for definition in ("proxy", "exact"):
            share = rng.dirichlet(np.ones(4))
            weight = rng.dirichlet(np.ones(4))
            for i, quadrant in enumerate(QUADRANTS):
                key = f"train/quadrant/{definition}/{quadrant}"
                row[f"{key}/tokens"] = share[i]
                row[f"{key}/weight"] = weight[i]
                row[f"{key}/dH"] = float(rng.normal(0, 0.01))
        counts = rng.poisson(0.5, len(WORDS)).astype(float)
        row["train/reflection/per_response"] = counts.sum()
        for word, c in zip(WORDS, counts):
            row[f"train/reflection/{word}"] = c
        rows.append(row)
        if step % 10 == 9:  # a separate, sparse validation row at the same step
            avg = float(rng.uniform(0.1, 0.5))
            rows.append(
                {
                    "epoch": 0,
                    "step": step,
                    "val/avg@n": avg,
                    "val/pass@1": avg,
                    "val/pass@8": min(1.0, avg + 0.3),
                    "val/distinct_correct": float(rng.uniform(1, 4)),
                }
            )
    run_dir.mkdir(parents=True)
    pd.DataFrame(rows).to_csv(run_dir / "metrics.csv", index=False)
    if name is not None:
        (run_dir / "hparams.yaml").write_text(f"run_name: {name}\nlr: 1.0e-06\n")
    return run_dir


def test_load_run_merges_sparse_rows_and_names_runs(tmp_path):
    from stare_lightning.analysis.runs import load_run, load_runs

    named = write_fake_run(tmp_path / "logs" / "stare" / "version_0", seed=0, steps=20, name="stare-o1")
    write_fake_run(tmp_path / "logs" / "grpo" / "version_0", seed=1, steps=20)
    df = load_run(named)
    assert df.index.is_monotonic_increasing and len(df) == 20
    assert df.attrs["name"] == "stare-o1"
    assert not math.isnan(df.loc[9, "train/entropy"]) and not math.isnan(df.loc[9, "val/avg@n"])
    assert df["val/avg@n"].notna().sum() == 2
    runs = load_runs(str(tmp_path / "logs"))
    assert sorted(runs) == ["grpo/version_0", "stare-o1"]


def execute_notebook(run_dirs: list[Path] | None, figures: Path):
    """Run the notebook on ``run_dirs`` (None: its committed data; the kernel inherits this process's
    environment); returns it executed."""
    import nbformat
    from nbclient import NotebookClient

    env = {
        "STARE_RUN_DIRS": os.pathsep.join(str(r) for r in run_dirs or []),
        "STARE_FIGURE_DIR": str(figures),
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        "MPLBACKEND": "Agg",
    }
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        nb = nbformat.read(NOTEBOOK, as_version=4)
        client = NotebookClient(
            nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOK.parent)}}
        )
        client.execute()
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return nb


@pytest.mark.slow
def test_notebook_runs_on_two_fake_runs_and_writes_pngs(tmp_path):
    run_a = write_fake_run(tmp_path / "runs" / "stare_o1", seed=0, name="stare-o1")
    run_b = write_fake_run(tmp_path / "runs" / "grpo_ds", seed=1)
    figures = tmp_path / "figures"
    nb = execute_notebook([run_a, run_b], figures)
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors
    pngs = sorted(p.name for p in figures.glob("*.png"))
    assert pngs == ["overview.png", "quadrant_mass.png", "reflection_words.png"]
    assert all((figures / p).stat().st_size > 10_000 for p in pngs)
    assert len(shown_images(nb)) == 3


def shown_images(nb) -> list:
    return [o for c in nb.cells for o in c.get("outputs", []) if "image/png" in o.get("data", {})]


COMMITTED = {  # notebook -> (its data folder, runs in it, figures it shows)
    "async_study.ipynb": (
        "data/async_study",
        [f"{arm}_k{k}_seed{seed}" for arm in ("grpo_ds", "stare_o1") for k in (0, 1, 2, 4) for seed in (1, 2, 3)]
        + [f"stare_o1_k4_uncorrected_seed{seed}" for seed in (1, 2, 3)],
        1,
    ),
    "entropy_controllers.ipynb": (
        "data/entropy_controllers",
        [
            f"{arm}_seed{seed}"
            for arm in ("stare_o1_linear", "entropic_pi", "entropy_bonus_adaptive")
            for seed in range(1, 11)
        ],
        2,
    ),
    "entropy_dynamics.ipynb": ("data/default_runs", ["grpo_ds", "stare_o1"], 3),
    "offline_headline.ipynb": (
        "data/offline_headline",
        [f"{arm}_seed{seed}" for arm in ("grpo_ds", "stare_o1", "stare_o1_w2") for seed in range(1, 11)],
        2,
    ),
    "lora_study.ipynb": (
        "data/lora_study",
        ["probe_1e-4_seed0", "probe_2e-5_seed0"]
        + [f"{arm}_seed{seed}" for arm in ("grpo_ds_lora", "stare_o1_lora") for seed in (0, 1, 2)],
        2,
    ),
    "offline_tradeoff.ipynb": (
        "data/offline_tradeoff",
        ["grpo_ds_seed1", "grpo_ds_seed2", "grpo_ds_seed3", "stare_c2_seed1", "stare_o1_adaptive_seed3"],
        1,
    ),
    "selector_ablation.ipynb": (
        "data/selector_ablation",
        [f"{arm}_seed{seed}" for arm in ("stare_o1", "stare_o1_random", "stare_o1_entropy") for seed in (1, 2, 3)],
        2,
    ),
    "smollm2_study.ipynb": (
        "data/smollm2_study",
        [
            "grpo_ds_seed0",
            "grpo_ds_seed1",
            "grpo_ds_seed2",
            "stare_c2_seed0",
            "stare_c2_seed1",
            "stare_c2_seed2",
            "stare_o1_adaptive_seed0",
            "stare_o1_adaptive_seed1",
            "stare_o1_adaptive_seed2",
            "stare_o1_seed0",
            "stare_o1_seed1",
            "stare_o1_seed2",
            "stare_c2_m05_seed0",
            "stare_o1_target07_seed0",
        ],
        2,
    ),
}


@pytest.mark.parametrize("name", sorted(COMMITTED))
def test_committed_notebook_is_executed_with_its_figures(name):
    import nbformat

    nb = nbformat.read(NOTEBOOK.parent / name, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.get("execution_count") for c in code), "commit the notebook executed"
    assert len(shown_images(nb)) == COMMITTED[name][2]


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(COMMITTED))
def test_notebook_runs_on_its_committed_summaries(tmp_path, name, monkeypatch):
    import nbformat
    from nbclient import NotebookClient

    from stare_lightning.analysis.runs import load_runs

    data, expected_runs, figures = COMMITTED[name]
    committed = load_runs(NOTEBOOK.parent / data)
    assert set(expected_runs) <= set(committed)
    assert all(df["train/entropy"].notna().all() for df in committed.values())
    nb = nbformat.read(NOTEBOOK.parent / name, as_version=4)
    for variable in ("STARE_RUN_DIRS", "STARE_STUDY_DIR"):  # the kernel inherits them; restored afterwards
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("STARE_FIGURE_DIR", str(tmp_path))
    NotebookClient(
        nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOK.parent)}}
    ).execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors
    assert len(shown_images(nb)) == figures


def test_summaries_of_a_sweep_keep_the_plotted_columns_and_name_runs(tmp_path):
    import yaml

    from stare_lightning.analysis.runs import load_runs
    from stare_lightning.analysis.summaries import summarize_sweep

    for index, (algorithm, adaptive, seed) in enumerate([("grpo_ds", False, 0), ("stare_o1", True, 1)]):
        logs = write_fake_run(tmp_path / "sweep" / f"{index}_job" / "logs", seed=seed, steps=12)
        hparams = {"seed": seed, "algorithm": {"name": algorithm, "stare": {"adaptive": adaptive}}}
        hparams |= {"rollout": {"backend": "server", "max_staleness": 2}, "optim": {"lr": 1e-3}}
        (logs / "hparams.yaml").write_text(yaml.safe_dump(hparams))
    written = summarize_sweep(tmp_path / "sweep", tmp_path / "summary")
    kept = yaml.safe_load((written[0] / "hparams.yaml").read_text())
    assert kept["rollout"]["max_staleness"] == 2 and "optim" not in kept  # the rollout group, not every group
    assert [p.name for p in written] == ["grpo_ds_seed0", "stare_o1_adaptive_seed1"]
    runs = load_runs(tmp_path / "summary")
    assert sorted(runs) == ["grpo_ds_seed0", "stare_o1_adaptive_seed1"]
    full = next(iter(load_runs(tmp_path / "sweep" / "0_job" / "logs").values()))
    summary = runs["grpo_ds_seed0"]
    assert "epoch" not in summary.columns and set(summary.columns) <= set(full.columns)
    for column in ("train/entropy", "val/avg@n", "train/quadrant/exact/pos_high/dH"):
        assert np.allclose(summary[column].dropna(), full[column].dropna(), rtol=1e-5)
    # The scripts' command writes the same summaries.
    command = [
        sys.executable,
        "-m",
        "stare_lightning.analysis.summaries",
        str(tmp_path / "sweep"),
        str(tmp_path / "cli"),
    ]
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == [str(tmp_path / "cli" / p.name) for p in written]
    assert all(
        (tmp_path / "cli" / p.name / "metrics.csv").read_text() == (p / "metrics.csv").read_text() for p in written
    )
