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


def test_a_package_namespace_imports_a_name_only_when_asked_and_refuses_a_name_listed_twice(monkeypatch):
    """``lazy_exports``: each package's names grouped by the module that holds them."""
    import os
    import types

    from stare_lightning.lazy_exports import lazy_exports

    code = "import stare_lightning.metrics as m\nassert 'ClipFraction' in m.__all__ and 'ClipFraction' in dir(m)\n"
    assert _modules_after(code) == set()  # listed, not imported
    assert "torch" in _modules_after("from stare_lightning.metrics import ClipFraction")
    package = types.ModuleType("lazy_probe")
    monkeypatch.setitem(sys.modules, "lazy_probe", package)
    getter, _, names = lazy_exports("lazy_probe", {"json": ("dumps", "loads"), "os.path": ("join",)})
    assert names == ["dumps", "join", "loads"] and getter("join") is os.path.join and package.join is os.path.join
    with pytest.raises(AttributeError, match="has no attribute 'dump'"):
        getter("dump")
    with pytest.raises(ValueError, match=r"exports 'join' from both json and os\.path"):
        lazy_exports("lazy_probe", {"json": ("join",), "os.path": ("join",)})
