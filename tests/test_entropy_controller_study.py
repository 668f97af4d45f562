"""The entropy-controller study script (scripts/entropy_controller_study.sh): every arm composes into a valid run with
the settings its header states, and the arms it shares with scripts/offline_headline.sh are the committed ones."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from stare_lightning.cli import compose, prepare_config

REPO = Path(__file__).resolve().parents[1]


def arms(script: str) -> dict[str, list[str]]:
    """The ARMS table of a study script: arm -> its overrides (backslash-continued lines joined)."""
    text = (REPO / "scripts" / script).read_text().replace("\\\n", "")
    table = re.search(r"declare -A ARMS=\((.*?)\n\)", text, re.S).group(1)
    return {arm: shlex.split(overrides) for arm, overrides in re.findall(r'\[(\w+)\]="([^"]*)"', table)}


STUDY = arms("entropy_controller_study.sh")


def test_the_shared_arms_are_the_headline_study_s():
    headline = arms("offline_headline.sh")
    assert {arm: STUDY[arm] for arm in headline} == headline
    assert set(STUDY) - set(headline) == {"stare_o1_linear", "entropic_pi", "entropy_bonus_adaptive"}


@pytest.mark.parametrize("arm", sorted(STUDY))
def test_every_arm_composes_with_the_settings_it_states(arm, tmp_path):
    _, run = prepare_config(compose([f"output_dir={tmp_path}", "seed=1", *STUDY[arm]]))
    algorithm = run.algorithm
    assert algorithm.name == arm and run.trainer["max_steps"] == 300 and run.optim.lr == 3e-4
    assert algorithm.collection.dynamic_sampling  # every arm is GRPO-ds underneath
    expected = {
        "grpo_ds": (False, "none", None),
        "stare_o1": (True, "none", None),
        "stare_o1_w2": (True, "none", None),
        "stare_o1_linear": (True, "none", None),
        "entropic_pi": (False, "pi", None),
        "entropy_bonus_adaptive": (False, "none", 0.3),
    }[arm]
    assert (algorithm.stare.enabled, algorithm.entropy_control.name, algorithm.entropy_bonus.target) == expected
    if algorithm.stare.enabled:
        assert algorithm.stare.w == (2.0 if arm == "stare_o1_w2" else 3.0)
    schedule = algorithm.stare
    if arm == "stare_o1_linear":
        assert (schedule.target_schedule, schedule.target_entropy, schedule.target_end) == ("linear", 0.35, 0.2)
        assert schedule.target_horizon == 300
    else:
        assert schedule.target_schedule == "constant" and schedule.target_entropy == 0.3
    pi = algorithm.entropy_control.pi
    assert (pi.target, pi.kp, pi.ki, pi.integral_limit, pi.max_signal) == (0.3, 2.0, 0.1, 2.0, 0.5)
    bonus = algorithm.entropy_bonus
    if arm == "entropy_bonus_adaptive":
        assert (bonus.coef, bonus.coef_lr, bonus.coef_max) == (0.0, 0.002, 0.1)
