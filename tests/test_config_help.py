"""``fit --help``: the groups with their options, the keys changed most with the reference's meanings and allowed
values, a pointer to the full reference; the top-level help points to it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from stare_lightning import cli
from stare_lightning.config_help import COMMON_KEYS
from stare_lightning.config_reference import config_keys

REPO = Path(__file__).resolve().parents[1]


def _squeezed(text: str) -> str:
    return " ".join(text.split())


def test_fit_help_shows_groups_options_and_the_common_keys_with_the_references_words(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "stare_lightning", "fit", "--help"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    text = _squeezed(done.stdout)
    assert "_target_: lightning.Trainer" not in done.stdout  # not Hydra's dump of the whole config
    assert not any(tmp_path.iterdir()), "--help wrote files"
    conf = Path(cli.config_dir())
    for group in ("algorithm", "data", "model", "rollout", "trainer", "experiment"):
        options = sorted(path.stem for path in (conf / group).glob("*.yaml"))
        assert f" {group} " in text, group
        for option in options:
            assert f" {option} " in text or f" {option}* " in text, (group, option)
    assert " stare_o1* " in text and " tiny* " in text and " countdown* " in text  # the default run's choices
    reference = {item.key: item for item in config_keys()}
    assert 18 <= len(COMMON_KEYS) <= 24
    for key in COMMON_KEYS:
        assert f" {key} (" in text, key
        if key in reference:  # a schema key: the reference's meaning and rule, word for word
            item = reference[key]
            assert _squeezed(item.doc) in text, key
            assert not item.allowed or _squeezed(item.allowed)[:150] in text, key
    assert "Optimizer steps. Lightning: Stop training after this number of steps." in text
    assert "reference/configuration.md" in text and "python -m stare_lightning.config_reference" in text


def test_the_top_level_help_points_to_fit_help():
    assert "python -m stare_lightning fit --help" in cli.usage()
