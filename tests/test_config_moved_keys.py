"""Keys that moved into the algorithm's sub-groups: every old key has a real new place, and a command line or
config file that still uses one is refused with one line naming it, before anything runs."""

from __future__ import annotations

import os

import pytest
from omegaconf import OmegaConf

from stare_lightning.algorithms.config import AlgorithmConfig
from stare_lightning.config.moved_keys import MOVED_KEYS, REGROUPED_KEYS, check_override_keys, moved_key_error
from stare_lightning.run_config import RunConfig
from tests import forked_cli


@pytest.mark.parametrize("old, new", sorted(MOVED_KEYS.items()))
def test_each_moved_key_names_a_key_of_the_schema_and_the_old_one_is_gone(old, new):
    schema = OmegaConf.structured(RunConfig)
    assert OmegaConf.select(schema, new, throw_on_missing=False, default="absent") != "absent"
    assert OmegaConf.select(schema, old, default="absent") == "absent"


def test_regrouped_keys_hold_an_entry_name_and_its_settings():
    schema = OmegaConf.structured(AlgorithmConfig)
    for key in REGROUPED_KEYS:
        node = OmegaConf.select(schema, key.removeprefix("algorithm."))
        assert OmegaConf.is_dict(node) and isinstance(node.name, str)


@pytest.mark.parametrize(
    "override, message",
    [
        (
            "algorithm.kl_coef=0.1",
            "algorithm.kl_coef has moved (override 'algorithm.kl_coef=0.1'): it is algorithm.kl.coef now",
        ),
        ("+algorithm.ppo_epochs=2", "it is algorithm.update.ppo_epochs now"),
        ("algorithm.policy_loss=gspo", "the entry it uses is algorithm.policy_loss.name=gspo"),
        ("algorithm.entropy_control=clip_cov,kl_cov", "algorithm.entropy_control.name=clip_cov,kl_cov"),
    ],
)
def test_an_override_of_a_moved_key_is_refused_with_its_new_place(override, message):
    with pytest.raises(ValueError) as info:
        check_override_keys([override])
    assert message in str(info.value)


def test_new_keys_and_group_choices_pass():
    check_override_keys(["algorithm=gspo", "algorithm.kl.coef=0.1", "algorithm.policy_loss.name=cispo", "seed=1"])


def test_a_config_file_with_a_moved_key_gets_the_same_line():
    """What Hydra raises for an experiment file still written with a flat key, turned into the one line."""
    with pytest.raises(Exception) as info:
        OmegaConf.merge(OmegaConf.structured(RunConfig), {"algorithm": {"dynamic_sampling": True}})
    error = moved_key_error(info.value)
    assert error is not None
    assert str(error) == (
        "algorithm.dynamic_sampling has moved (in a config file): it is algorithm.collection.dynamic_sampling now"
    )
    assert moved_key_error(ValueError("something else")) is None


def test_the_cli_refuses_a_moved_key_in_one_line_before_anything_runs(tmp_path):
    env = {**os.environ, "STARE_LIGHTNING_CACHE": str(tmp_path / "cache")}
    done = forked_cli.run(["fit", "algorithm.dynamic_sampling=true"], cwd=tmp_path, env=env, timeout=300)
    assert done.returncode != 0
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    assert lines == [
        "error: algorithm.dynamic_sampling has moved (override 'algorithm.dynamic_sampling=true'): it is "
        "algorithm.collection.dynamic_sampling now (ValueError; verbose=true shows the traceback)"
    ]
    assert not (tmp_path / "outputs").exists()  # refused before Hydra made a run directory
