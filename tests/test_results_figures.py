"""Figures the README and the results pages quote, computed again from the committed data they were read from.

Each test finds its sentence on the page (a pattern anchored on the words around the figures, so a reworded
sentence fails loudly instead of passing unchecked), recomputes the figures from the CSVs under notebooks/data or the
curves under docs/assets/figures, and compares them at the rounding the page prints.
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

REPO = Path(__file__).resolve().parents[1]
LORA, FULL = REPO / "notebooks" / "data" / "lora_study", REPO / "notebooks" / "data" / "smollm2_study"
SEEDS = (0, 1, 2)
NUMBER = r"([+-]?\d+\.\d+)"


def quoted(page: str, pattern: str) -> tuple[str, ...]:
    """The figures ``pattern`` captures in ``page`` (line breaks read as spaces)."""
    text = " ".join((REPO / page).read_text().split())
    match = re.search(pattern, text)
    assert match, f"{page} no longer has the sentence {pattern!r}: update the page and this test together"
    return match.groups()


def entropy_by_step(run: Path) -> pd.Series:
    rows = pd.read_csv(run / "metrics.csv")
    rows = rows[rows["train/entropy"].notna()].drop_duplicates("step", keep="last")
    return rows.set_index("step")["train/entropy"].sort_index()


def slope_per_20_steps(entropy: pd.Series, last: int) -> tuple[float, float]:
    """Least-squares slope of the last ``last`` steps and its standard error, both in nats per 20 steps."""
    tail = entropy.iloc[-last:]
    x, y = tail.index.to_numpy(dtype=float), tail.to_numpy()
    dx = x - x.mean()
    slope = (dx * (y - y.mean())).sum() / (dx**2).sum()
    residuals = y - y.mean() - slope * dx
    error = np.sqrt((residuals**2).sum() / (len(x) - 2) / (dx**2).sum())
    return 20 * slope, 20 * error


def fitted(study: Path, arm: str, last: int) -> list[tuple[float, float]]:
    return [slope_per_20_steps(entropy_by_step(study / f"{arm}_seed{seed}"), last) for seed in SEEDS]


def test_lora_stare_levels_off_over_the_last_20_steps_on_two_seeds_of_three():
    lora, full = fitted(LORA, "stare_o1_lora", 20), fitted(FULL, "stare_o1", 20)
    assert sum(slope >= 0 for slope, _ in lora) == 2 and all(slope < 0 for slope, _ in full)
    slopes = tuple(f"{slope:+.3f}" for slope, _ in lora)
    readme = quoted(
        "README.md",
        rf"levelled off over the last 20 steps on two of three seeds \(slopes {NUMBER}, {NUMBER} and {NUMBER} nats per "
        rf"20 steps, each with a standard error of about {NUMBER}\)",
    )
    assert readme[:3] == slopes and {f"{error:.2f}" for _, error in lora} == {readme[3]}
    page = quoted(
        "docs/results/lora.md",
        rf"A line fitted to the last 20 steps has slopes {NUMBER}, {NUMBER} and {NUMBER} nats per 20 steps "
        rf"\(standard errors {NUMBER}-{NUMBER}\): level on two seeds of three \(full fine-tuning's STARE-O1: "
        rf"{NUMBER}, {NUMBER} and {NUMBER}\)",
    )
    errors = [error for _, error in lora]
    assert page[:3] == slopes and page[3:5] == (f"{min(errors):.3f}", f"{max(errors):.3f}")
    assert page[5:] == tuple(f"{slope:+.3f}" for slope, _ in full)


def test_lora_stare_still_falls_over_the_last_40_steps_on_every_seed():
    lora, full = fitted(LORA, "stare_o1_lora", 40), fitted(FULL, "stare_o1", 40)
    falls = [-slope for slope, _ in lora]
    errors_from_zero = [-slope / error for slope, error in lora]
    readme = quoted(
        "README.md",
        rf"over the last 40 steps every seed still fell \({NUMBER}-{NUMBER} nats per 20 steps, each at least {NUMBER} "
        r"standard errors\)",
    )
    assert readme[:2] == (f"{min(falls):.3f}", f"{max(falls):.3f}") and min(errors_from_zero) >= float(readme[2])
    page = quoted(
        "docs/results/lora.md",
        rf"every LoRA seed still falls, by {NUMBER}, {NUMBER} and {NUMBER} nats per 20 steps \({NUMBER}, {NUMBER} and "
        rf"{NUMBER} standard errors\), as the full fine-tune's STARE-O1 did \({NUMBER}, {NUMBER} and {NUMBER};",
    )
    assert page[:3] == tuple(f"{fall:.3f}" for fall in falls)
    assert page[3:6] == tuple(f"{t:.1f}" for t in errors_from_zero)
    assert page[6:] == tuple(f"{-slope:.3f}" for slope, _ in full)


def ten_step_means(arm: str, first: int) -> list[float]:
    return [entropy_by_step(LORA / f"{arm}_seed{seed}").loc[first : first + 9].mean() for seed in SEEDS]


def span(values, digits: int) -> tuple[str, str]:
    return f"{min(values):.{digits}f}", f"{max(values):.{digits}f}"


def test_the_ten_step_means_of_the_last_20_steps():
    stare = ten_step_means("stare_o1_lora", 80) + ten_step_means("stare_o1_lora", 90)
    readme = quoted("README.md", rf"with 10-step means of {NUMBER}-{NUMBER} nats over steps 80-99, while GRPO-ds kept")
    assert readme == span(stare, 2)
    page = quoted(
        "docs/results/lora.md",
        rf"Its 10-step means over steps 80-89 and 90-99 are {NUMBER}-{NUMBER} nats on every seed, while GRPO-ds' keep "
        rf"falling \({NUMBER}-{NUMBER} over steps 80-89, {NUMBER}-{NUMBER} over 90-99\)",
    )
    grpo = span(ten_step_means("grpo_ds_lora", 80), 2) + span(ten_step_means("grpo_ds_lora", 90), 2)
    assert page == span(stare, 2) + grpo


def per_run(study: Path, arms: tuple[str, ...], column: str, reduce: str) -> list[float]:
    return [
        getattr(pd.read_csv(study / f"{arm}_seed{s}" / "metrics.csv")[column], reduce)() for arm in arms for s in SEEDS
    ]


def test_the_lora_page_quotes_the_logged_memory_and_step_times():
    lora, full = ("grpo_ds_lora", "stare_o1_lora"), ("grpo_ds", "stare_o1")
    memory = quoted(
        "docs/results/lora.md",
        rf"the six LoRA runs peaked at {NUMBER}-{NUMBER} GiB resident \(each run's largest `train/memory/peak_gib`\) "
        rf"against {NUMBER}-{NUMBER} GiB in the full fine-tuning study's six runs of the same two arms",
    )
    peak = "train/memory/peak_gib"
    assert memory == span(per_run(LORA, lora, peak, "max"), 2) + span(per_run(FULL, full, peak, "max"), 2)
    times = quoted(
        "docs/results/lora.md",
        rf"the median step \(`train/time/step_s`\) took {NUMBER}-{NUMBER} s with LoRA against {NUMBER}-{NUMBER} s with "
        r"full fine-tuning; in the LoRA runs the rollout took (\d+)-(\d+) s of it and the update (\d+)-(\d+) s",
    )
    step = "train/time/step_s"
    assert times[:4] == span(per_run(LORA, lora, step, "median"), 1) + span(per_run(FULL, full, step, "median"), 1)
    parts = span(per_run(LORA, lora, "train/time/rollout", "median"), 0)
    assert times[4:] == parts + span(per_run(LORA, lora, "train/time/update", "median"), 0)


def test_the_smollm2_page_quotes_the_jobs_logged_step_times():
    jobs = sorted(path for path in FULL.iterdir() if (path / "metrics.csv").is_file())
    medians = [pd.read_csv(job / "metrics.csv")["train/time/step_s"].median() for job in jobs]
    times = quoted("docs/results/smollm2.md", rf"the jobs' median step, `train/time/step_s`, took {NUMBER}-{NUMBER} s")
    assert len(jobs) >= 10 and times == span(medians, 1)


TRL_CURVES = REPO / "docs" / "assets" / "figures" / "trl_entropy.json"


def test_the_trl_guide_quotes_its_window_and_when_trl_grpo_reached_the_target():
    """Steps are numbered from 1, as benchmarks/trl_entropy.py plots them; the window is steps 101-150."""
    curves = json.loads(TRL_CURVES.read_text())
    curves = {arm: pd.Series(values, index=range(1, len(values) + 1)) for arm, values in curves.items()}
    window = quoted(
        "docs/guides/trl.md",
        rf"this project's GRPO {NUMBER} \({NUMBER}\), its STARE-O1 {NUMBER} \({NUMBER}\); TRL's GRPO {NUMBER} "
        rf"\({NUMBER}\), TRL with STARE-O1 {NUMBER} \({NUMBER}\)",
    )
    expected = []
    for arm in ("project_grpo", "project_stare_o1", "trl_grpo", "trl_stare_o1"):
        steps = curves[arm].loc[101:150]
        assert len(steps) == 50
        expected += [f"{steps.mean():.3f}", f"{steps.min():.3f}"]
    assert list(window) == expected
    trl = curves["trl_grpo"]
    reached = quoted(
        "docs/guides/trl.md",
        r"TRL's GRPO first logged an entropy at or below 0\.3 at step (\d+), and its 5- and 10-step means \(centred or "
        r"trailing\) first reached 0\.3 at steps (\d+)-(\d+)",
    )
    smoothed = []
    for width in (5, 10):
        smoothed += [first_at_or_below(trl.rolling(width, center=centred).mean(), 0.3) for centred in (True, False)]
    assert reached == (str(first_at_or_below(trl, 0.3)), str(min(smoothed)), str(max(smoothed)))


def first_at_or_below(curve: pd.Series, level: float) -> int:
    return int(curve[curve <= level].index[0])


@pytest.mark.parametrize("page", ["README.md", "docs/results/lora.md"])
def test_no_page_says_lora_stopped_the_fall(page):
    """The data show a levelling off over the last 20 steps on two seeds of three, not a fall stopped on all three."""
    text = " ".join((REPO / page).read_text().split())
    assert "stopped the fall" not in text and "stopped the entropy's fall" not in text and "all three seeds" not in text


# ------------------------------------------------------------------------------------- the entropy controllers
HEADLINE, CONTROLLERS = (
    REPO / "notebooks" / "data" / "offline_headline",
    REPO / "notebooks" / "data" / "entropy_controllers",
)
CONTROLLER_ARMS = ("grpo_ds", "stare_o1_w2", "stare_o1_linear", "entropic_pi", "entropy_bonus_adaptive")
T_975_9 = 2.262157  # Student's t, 97.5% quantile, 9 degrees of freedom (from tables)
PAIRED = rf"{NUMBER} \[{NUMBER}, {NUMBER}\]"  # a paired difference as the pages print it: -0.065 [-0.071, -0.060]


@functools.cache
def outcomes(run: Path) -> dict[str, float]:
    """Entropy and distinct correct answers over the last 50 training steps, avg@4 and pass@4 over the last three
    validations: the window scripts/entropy_controller_study.sh fixed."""
    rows = pd.read_csv(run / "metrics.csv")
    last = {column: rows[column].dropna() for column in rows.columns}
    return {
        "entropy": last["train/entropy"].iloc[-50:].mean(),
        "distinct": last["train/distinct_correct"].iloc[-50:].mean(),
        "pass@1": last["val/avg@n"].iloc[-3:].mean(),
        "pass@4": last["val/pass@4"].iloc[-3:].mean(),
    }


@functools.cache
def paired_to_stare_o1(arm: str) -> dict[str, tuple[float, float, float]]:
    """Arm minus STARE-O1 at W = 3 over seeds 1-10: mean difference and its 95% t interval, per outcome."""
    folder = HEADLINE if arm in ("grpo_ds", "stare_o1", "stare_o1_w2") else CONTROLLERS  # the committed arms
    pairs = [(outcomes(folder / f"{arm}_seed{s}"), outcomes(HEADLINE / f"stare_o1_seed{s}")) for s in range(1, 11)]
    out = {}
    for name in ("entropy", "distinct", "pass@1", "pass@4"):
        d = np.array([a[name] - b[name] for a, b in pairs])
        half = T_975_9 * d.std(ddof=1) / np.sqrt(len(d))
        out[name] = (d.mean(), d.mean() - half, d.mean() + half)
    return out


def test_the_controller_page_quotes_each_arm_against_stare_o1_as_its_data_say():
    page = " ".join((REPO / "docs" / "results" / "entropy-controllers.md").read_text().split())
    cell = PAIRED
    for arm in CONTROLLER_ARMS:
        match = re.search(rf"\| `{arm}` \| {cell} \| {cell} \| {cell} \| {cell} \|", page)
        assert match, f"docs/results/entropy-controllers.md has no paired row for {arm}"
        expected = paired_to_stare_o1(arm)
        quoted_row = [float(x) for x in match.groups()]
        computed = [round(v, 3) for name in ("entropy", "distinct", "pass@1", "pass@4") for v in expected[name]]
        assert quoted_row == pytest.approx(computed, abs=0.0015), arm
    # The verdict the page states follows from those intervals: no arm wins by the script's criterion.
    winners = []
    for arm in CONTROLLER_ARMS:
        (_, lo1, hi1), (_, lo4, hi4) = (paired_to_stare_o1(arm)[k] for k in ("pass@1", "pass@4"))
        if (lo1 > 0 and hi4 > 0) or (lo1 <= 0 <= hi1 and lo4 > 0):
            winners.append(arm)
    assert winners == [] and "no arm wins" in page


def test_the_readme_quotes_the_controller_study_as_its_data_say():
    linear, pi = paired_to_stare_o1("stare_o1_linear"), paired_to_stare_o1("entropic_pi")
    cell = PAIRED
    figures = quoted(
        "README.md",
        rf"The annealed target comes closest: pass@1 {cell} and pass@4 {cell} against W = 3, for an entropy of "
        rf"{NUMBER} nats against {NUMBER}\. The PI controller ends at GRPO-ds's entropy \({NUMBER} nats\) and loses "
        rf"pass@4 \({cell}\)",
    )
    folders = {"stare_o1_linear": CONTROLLERS, "stare_o1": HEADLINE, "entropic_pi": CONTROLLERS}
    entropy = {
        arm: np.mean([outcomes(folder / f"{arm}_seed{seed}")["entropy"] for seed in range(1, 11)])
        for arm, folder in folders.items()
    }
    expected = [*linear["pass@1"], *linear["pass@4"], entropy["stare_o1_linear"], entropy["stare_o1"]]
    expected += [entropy["entropic_pi"], *pi["pass@4"]]
    assert [float(x) for x in figures] == pytest.approx([round(v, 3) for v in expected], abs=0.0015)
