"""Reading the run's schema loads no implementation: no torch, Lightning or transformers on import, and none when
Hydra builds the schema with its defaults (the defaults are checked against their registries here instead)."""

from __future__ import annotations

import subprocess
import sys

import pytest

HEAVY = ("torch", "lightning", "transformers", "vllm")


def _modules_after(code: str) -> set[str]:
    probe = f"{code}\nimport sys\nprint(' '.join(sorted(m for m in {HEAVY!r} if m in sys.modules)))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=120)
    return set(out.stdout.split())


def test_importing_the_run_schema_loads_no_implementation():
    assert _modules_after("import stare_lightning.run_config") == set()


def test_building_the_default_schema_loads_no_implementation():
    """What Hydra does to compose (``--cfg job``): the structured default of every group."""
    code = "from omegaconf import OmegaConf\nfrom stare_lightning.run_config import RunConfig\n"
    code += "OmegaConf.structured(RunConfig)"
    assert _modules_after(code) == set()


def test_every_default_is_a_registered_choice():
    """The schema skips looking up its own defaults; here each lookup is forced (as the reference pages do)."""
    from stare_lightning.algorithms.config import AlgorithmConfig, STAREConfig
    from stare_lightning.config.checks import recorded_rules

    with recorded_rules() as rules:
        AlgorithmConfig(stare=STAREConfig(enabled=True))
    keys = ("algorithm.advantage.name", "algorithm.policy_loss.name", "algorithm.entropy_control.name")
    for key in (*keys, "algorithm.update.loss_agg", "algorithm.stare.selector", "algorithm.stare.scope"):
        assert rules[key].startswith("one of ["), rules


@pytest.mark.parametrize(
    "group, key, value",
    [("policy_loss", "name", "trpo"), ("advantage", "name", "gae2"), ("update", "loss_agg", "mean")],
)
def test_a_choice_other_than_the_default_is_still_checked(group, key, value):
    from stare_lightning.algorithms.config import AlgorithmConfig

    with pytest.raises(ValueError, match=rf"algorithm\.{group}\.{key}='{value}' is not allowed: choose one of \["):
        AlgorithmConfig(**{group: {key: value}})
