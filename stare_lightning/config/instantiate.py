"""The one door through which configs become objects.

Configs travel inside checkpoints and get shared between people, so a ``_target_`` must not be able to
name arbitrary code (``os.system`` and friends). Every ``instantiate`` in the project goes through
``safe_instantiate``, which refuses targets outside an allow-list of module prefixes.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import hydra.utils
from omegaconf import DictConfig, ListConfig, OmegaConf

DEFAULT_ALLOWED_PREFIXES: tuple[str, ...] = (
    "stare_lightning.",
    "torch.optim.",
    "lightning.",
    "transformers.",
)


class DisallowedTargetError(ValueError):
    pass


def _iter_targets(node: Any, path: str) -> Iterable[tuple[str, str]]:
    if isinstance(node, (DictConfig, Mapping)):
        for key, value in node.items():
            child = f"{path}.{key}" if path else str(key)
            if key == "_target_":
                yield path or "<root>", str(value)
            else:
                yield from _iter_targets(value, child)
    elif isinstance(node, (ListConfig, Sequence)) and not isinstance(node, str):
        for index, value in enumerate(node):
            yield from _iter_targets(value, f"{path}[{index}]")


def check_targets(node: Any, extra_allowed: Sequence[str] = (), *, where: str = "") -> None:
    """Raise ``DisallowedTargetError`` naming the config key of the first target outside the allow-list."""
    allowed = tuple(DEFAULT_ALLOWED_PREFIXES) + tuple(extra_allowed)
    for key, target in _iter_targets(node, where):
        if not target.startswith(allowed):
            raise DisallowedTargetError(
                f"{key}._target_={target!r} is not allowed; targets must start with one of {list(allowed)}. "
                "Add a prefix to `allowed_targets` in the run config to trust more code."
            )


def safe_instantiate(node: Any, *args: Any, extra_allowed: Sequence[str] = (), where: str = "", **kwargs: Any) -> Any:
    """``hydra.utils.instantiate`` after checking every nested ``_target_`` against the allow-list."""
    if isinstance(node, Mapping) and not isinstance(node, DictConfig):
        node = OmegaConf.create(dict(node))
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
