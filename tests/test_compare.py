"""Seed statistics of `stare_lightning.analysis.compare` against independent computations on runs written here."""

from __future__ import annotations

import math
import statistics
import subprocess
import sys

import pytest
import yaml

from stare_lightning.analysis.compare import find_runs, main, run_outcomes, seed_statistics
from stare_lightning.analysis.student_t import t_quantile_975


def _write_run(folder, algorithm: str, seed: int, entropy: list[float], val_avg: list[float], pass4: list[float]):
    """A run as a fit logs it: sparse CSV rows (training every step, validation every 2 steps)."""
    folder.mkdir(parents=True)
    (folder / "hparams.yaml").write_text(yaml.safe_dump({"seed": seed, "algorithm": {"name": algorithm}}))
    rows = ["step,train/entropy,train/distinct_correct,val/avg@n,val/pass@4"]
    for step, value in enumerate(entropy):
        rows.append(f"{step},{value},{2 * value},,")
        if step % 2 == 0:
            rows.append(f"{step},,,{val_avg[step // 2]},{pass4[step // 2]}")
    (folder / "metrics.csv").write_text("\n".join(rows) + "\n")


def _t_cdf_mass(q: float, dof: int, pieces: int = 20_000) -> float:
    """P(|T| <= q) for Student's t by Simpson's rule on its density."""
    const = math.gamma((dof + 1) / 2) / (math.sqrt(dof * math.pi) * math.gamma(dof / 2))
    h = q / pieces
    total = 0.0
    for i in range(pieces + 1):
        x = i * h
        weight = 1 if i in (0, pieces) else (4 if i % 2 else 2)
        total += weight * const * (1 + x * x / dof) ** (-(dof + 1) / 2)
    return 2 * total * h / 3


@pytest.mark.parametrize("dof", [1, 2, 3, 5, 10, 29, 30, 31, 45, 200])
def test_t_quantile_leaves_five_percent_outside(dof):
    assert _t_cdf_mass(t_quantile_975(dof), dof) == pytest.approx(0.95, abs=2e-4)


@pytest.mark.parametrize(  # published two-sided 95% critical values (three decimals)
    "dof, table", [(1, 12.706), (4, 2.776), (31, 2.040), (40, 2.021), (60, 2.000), (120, 1.980), (10**6, 1.960)]
)
def test_t_quantile_matches_the_printed_tables_past_thirty(dof, table):
    assert round(t_quantile_975(dof), 3) == table


def test_t_quantile_refuses_a_single_value():
    with pytest.raises(ValueError, match="dof=0"):
        t_quantile_975(0)


def test_arms_seeds_and_paired_differences(tmp_path):
    entropy = {("grpo_ds", 1): 0.10, ("grpo_ds", 2): 0.20, ("grpo_ds", 3): 0.15,
               ("stare_o1", 1): 0.30, ("stare_o1", 2): 0.28, ("stare_o1", 3): 0.35, ("stare_o1", 4): 0.9}  # fmt: skip
    for job, ((algorithm, seed), level) in enumerate(sorted(entropy.items())):
        # 60 steps: the first 10 far off, so only a tail of 50 gives the level.
        series = [5.0] * 10 + [level] * 50
        _write_run(tmp_path / "sweep" / f"{job}_run" / "logs", algorithm, seed, series, [level / 2] * 30, [level] * 30)
    runs = find_runs(tmp_path / "sweep")
    assert sorted({r.arm for r in runs}) == ["grpo_ds", "stare_o1"]
    assert run_outcomes(runs[0].logs)["entropy"] == pytest.approx(0.10)
    stats = seed_statistics(runs).set_index(["arm", "outcome"])
    stare = [entropy["stare_o1", s] for s in (1, 2, 3, 4)]
    row = stats.loc[("stare_o1", "entropy")]
    assert row["seeds"] == 4
    assert row["mean"] == pytest.approx(statistics.mean(stare))
    assert row["sd"] == pytest.approx(statistics.stdev(stare))
    # Paired over the seeds both ran (1-3): seed 4 has no partner.
    diffs = [entropy["stare_o1", s] - entropy["grpo_ds", s] for s in (1, 2, 3)]
    # Student's t with 2 degrees of freedom has a closed-form quantile: (2p - 1) / sqrt(2p(1 - p)), 4.30265 at 97.5%.
    half = 0.95 / math.sqrt(2 * 0.975 * 0.025) * statistics.stdev(diffs) / math.sqrt(3)
    assert row["pairs"] == 3
    assert row["diff"] == pytest.approx(statistics.mean(diffs))
    assert (row["diff_lo"], row["diff_hi"]) == pytest.approx(
        (statistics.mean(diffs) - half, statistics.mean(diffs) + half)
    )
    assert stats.loc[("stare_o1", "val_avg@n"), "mean"] == pytest.approx(statistics.mean(stare) / 2)
    # Validation: the mean of the last three evaluations.
    _write_run(tmp_path / "one" / "logs", "grpo_ds", 0, [0.1] * 8, [0.1, 0.2, 0.4, 0.6], [0.5, 0.5, 0.5, 0.9])
    assert run_outcomes(tmp_path / "one" / "logs")["val_pass@4"] == pytest.approx((0.5 + 0.5 + 0.9) / 3)
    assert run_outcomes(tmp_path / "one" / "logs")["val_avg@n"] == pytest.approx(0.4)
    assert stats.loc[("grpo_ds", "distinct_correct"), "mean"] == pytest.approx(2 * 0.15)
    assert math.isnan(stats.loc[("grpo_ds", "entropy")].get("diff", math.nan))  # the baseline has no pair


def test_several_sweeps_name_their_arms_and_the_cli_writes_the_table(tmp_path, capsys):
    for sweep, algorithm in (("default", "grpo_ds"), ("default", "stare_o1"), ("stare_o1_w2", "stare_o1")):
        for seed in (1, 2):
            _write_run(
                tmp_path / sweep / f"{algorithm}_seed{seed}", algorithm, seed, [0.1 * seed] * 4, [0.5] * 2, [0.7] * 2
            )
    assert sorted({r.arm for r in find_runs(tmp_path)}) == [
        "default/grpo_ds",
        "default/stare_o1",
        "stare_o1_w2/stare_o1",
    ]
    with pytest.raises(ValueError, match="baseline='grpo'"):
        seed_statistics(find_runs(tmp_path), baseline="grpo")
    table = tmp_path / "out" / "seed_statistics.csv"
    main([str(tmp_path), "--table", str(table)])
    printed = capsys.readouterr().out
    assert "| stare_o1_w2/stare_o1 | entropy | 2 | 0.150 +- 0.071 | +0.000 [+0.000, +0.000] |" in printed
    assert table.is_file() and (tmp_path / "comparison.png").is_file()


def test_a_study_of_arm_folders_keeps_the_arms_names(tmp_path):
    """The study scripts' layout, <arm>/seed<k>/logs: each folder is named after its arm, which it names once."""
    for algorithm in ("stare_o1", "stare_o1_random"):
        for seed in (1, 2):
            _write_run(tmp_path / algorithm / f"seed{seed}" / "logs", algorithm, seed, [0.1] * 4, [0.5] * 2, [0.7] * 2)
    assert sorted({r.arm for r in find_runs(tmp_path)}) == ["stare_o1", "stare_o1_random"]
    assert len(seed_statistics(find_runs(tmp_path), baseline="stare_o1"))


def test_the_adaptive_schedule_is_an_arm_of_its_own(tmp_path):
    """Summaries side by side (a study's committed data): STARE-O1 with a fixed W and with the adaptive schedule
    log the same algorithm name, and must not be pooled as one arm."""
    for label, adaptive in (("stare_o1_seed0", False), ("stare_o1_adaptive_seed0", True)):
        folder = tmp_path / label
        folder.mkdir()
        logged = {"seed": 0, "algorithm": {"name": "stare_o1", "stare": {"adaptive": adaptive}}}
        (folder / "hparams.yaml").write_text(yaml.safe_dump(logged))
        (folder / "metrics.csv").write_text("step,train/entropy\n0,0.5\n")
    assert sorted(r.arm for r in find_runs(tmp_path)) == ["stare_o1", "stare_o1_adaptive"]


def test_the_old_command_name_runs_the_same_comparison(tmp_path):
    """``python -m stare_lightning.compare``, the name scripts and notes written before the move use, is the same
    command as ``python -m stare_lightning.analysis.compare``: the same table, the CSV and the PNG."""
    for algorithm in ("grpo_ds", "stare_o1"):
        for seed in (1, 2):
            entropy = [0.1 * seed + (0.2 if algorithm == "stare_o1" else 0.0)] * 4
            _write_run(tmp_path / "sweep" / f"{algorithm}_seed{seed}", algorithm, seed, entropy, [0.5] * 2, [0.7] * 2)
    printed = {}
    for module in ("stare_lightning.compare", "stare_lightning.analysis.compare"):
        table = tmp_path / module / "seed_statistics.csv"
        command = [sys.executable, "-m", module, str(tmp_path / "sweep"), "--table", str(table)]
        done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        assert table.is_file() and (tmp_path / "sweep" / "comparison.png").is_file()
        printed[module] = done.stdout.replace(str(table), "<table>")
    assert "| stare_o1 | entropy | 2 | 0.350 +- 0.071 | +0.200 [+0.200, +0.200] |" in printed["stare_lightning.compare"]
    assert printed["stare_lightning.compare"] == printed["stare_lightning.analysis.compare"]
