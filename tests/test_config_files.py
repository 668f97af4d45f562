"""The YAML under ``conf/`` holds only what differs from the typed schema, and ``config/`` stays a leaf.

A value a file repeats is a value that can drift: the schema's default changes and the file silently pins the
old one. For a group file the baseline is what its defaults list (its parents) already gives on top of the
schema; for ``config.yaml`` the schema itself. Experiments (``@package _global_``) are recipes that state a
paper's or a study's values on purpose and are not checked.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from stare_lightning.algorithms import AlgorithmConfig
from stare_lightning.data.config import DataConfig
from stare_lightning.models.config import ModelConfig
from stare_lightning.rollout.config import RolloutConfig
from stare_lightning.run_config import RunConfig
from stare_lightning.tools.config import ToolsConfig

CONF = Path(__file__).resolve().parents[1] / "conf"
PACKAGE = Path(__file__).resolve().parents[1] / "stare_lightning"
TYPED_GROUPS = {
    "algorithm": AlgorithmConfig,
    "data": DataConfig,
    "model": ModelConfig,
    "rollout": RolloutConfig,
    "tools": ToolsConfig,
}
LABELS = {"name"}  # a recipe's label is its own, not a setting


def _own(path: Path) -> dict:
    return {k: v for k, v in (yaml.safe_load(path.read_text()) or {}).items() if k != "defaults"}


def _composed(group: str, name: str):
    """The group file ``name`` with its parents, merged onto the schema (as Hydra composes a group option)."""
    path = CONF / group / f"{name}.yaml"
    return OmegaConf.merge(_baseline(group, path), _own(path))


def _leaves(tree: dict, prefix: str = ""):
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            yield from _leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def _baseline(group: str, path: Path):
    """What the group file at ``path`` starts from: the schema with its defaults-list parents merged on."""
    parents = [d for d in (yaml.safe_load(path.read_text()) or {}).get("defaults", []) if d != "_self_"]
    # The group's node inside the run schema, as Hydra merges onto it (its dataclass instance, after its
    # __post_init__: e.g. model.lora is null there, not a rank-0 LoraConfig).
    base = OmegaConf.structured(RunConfig)[group]
    for parent in parents:
        base = OmegaConf.merge(base, _composed(group, parent))
    return base


@pytest.mark.parametrize(
    "path",
    [p for g in TYPED_GROUPS for p in sorted((CONF / g).glob("*.yaml"))],
    ids=lambda p: f"{p.parent.name}/{p.stem}",
)
def test_a_group_file_repeats_no_value_it_already_has(path):
    base = _baseline(path.parent.name, path)
    repeated = [
        f"{key}: {value!r}"
        for key, value in _leaves(_own(path))
        if key not in LABELS and value != "???" and OmegaConf.select(base, key, default=object()) == value
    ]
    assert not repeated, f"{path.relative_to(CONF)} repeats the schema's (or its parents') values: {repeated}"


def test_config_yaml_repeats_no_schema_default():
    schema = OmegaConf.structured(RunConfig)
    own = {k: v for k, v in _own(CONF / "config.yaml").items() if k != "hydra"}
    repeated = [
        f"{key}: {value!r}" for key, value in _leaves(own) if OmegaConf.select(schema, key, default=object()) == value
    ]
    assert not repeated, f"config.yaml repeats the schema's defaults: {repeated}"


def test_config_is_a_leaf_that_imports_no_feature_package():
    for path in sorted((PACKAGE / "config").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("stare_lightning"):
                assert node.module.startswith("stare_lightning.config"), f"config/{path.name} imports {node.module}"
