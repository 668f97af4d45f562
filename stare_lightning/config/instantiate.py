"""The one door through which configs become objects: ``hydra.utils.instantiate`` after the allow-list check.

Every ``instantiate`` in the project goes through ``safe_instantiate``; ``config/targets.py`` says what may be
constructed and why a package prefix is not enough. The run's ``allowed_targets`` (the user's opt-in) are checked
once, when the run config is built, and passed here as ``extra_allowed``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import hydra.utils
from omegaconf import DictConfig, OmegaConf

from stare_lightning.config.targets import DisallowedTargetError, check_opt_ins, check_targets

__all__ = ["DisallowedTargetError", "instantiate_collection", "safe_instantiate"]


def safe_instantiate(node: Any, *args: Any, extra_allowed: Sequence[str] = (), where: str = "", **kwargs: Any) -> Any:
    """``hydra.utils.instantiate`` after checking every nested ``_target_`` against the allow-list."""
    if isinstance(node, Mapping) and not isinstance(node, DictConfig):
        node = OmegaConf.create(dict(node))
    check_opt_ins(extra_allowed)
    check_targets(node, extra_allowed, where=where)
    return hydra.utils.instantiate(node, *args, **kwargs)


def instantiate_collection(node: Any, *, extra_allowed: Sequence[str] = (), where: str = "") -> list[Any]:
    """Instantiate every entry of a name -> config mapping (callbacks, loggers); ``null`` entries are skipped."""
    if node is None:
        return []
    objects = []
    for name, entry in node.items():
        if entry is None:
            continue
        if "_target_" not in entry:
            raise ValueError(f"{where}.{name} has no _target_; got keys {list(entry.keys())}")
        objects.append(safe_instantiate(entry, extra_allowed=extra_allowed, where=f"{where}.{name}"))
    return objects
