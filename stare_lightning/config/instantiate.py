"""The one door through which configs become objects.

Configs travel inside checkpoints and get shared between people, so a ``_target_`` must not be able to
name arbitrary code (``os.system`` and friends). Every ``instantiate`` in the project goes through
``safe_instantiate``, which refuses targets outside an allow-list of module prefixes. The check is on the
object, not the string: the dotted path is resolved as Hydra resolves it, and every module it passes through
and the object it ends at must be defined under an allowed prefix, so ``stare_lightning.x.os.system`` (a path
through a module's ``os`` attribute) is refused like ``os.system``. Private and dunder steps are refused outright.
"""

from __future__ import annotations

import importlib
import types
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


def _home(obj: Any) -> str | None:
    """Where ``obj`` is defined: a module's name, or ``module.qualname`` of a class or function."""
    if isinstance(obj, types.ModuleType):
        return obj.__name__ + "."
    module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    return f"{module}.{qualname}" if isinstance(module, str) and isinstance(qualname, str) else None


def _resolution(target: str) -> Iterable[tuple[str, Any]]:
    """(dotted path so far, object) for each step of ``target``: the longest importable module, then attributes."""
    parts = target.split(".")
    for depth in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:depth]))
            break
        except ImportError:
            continue
    else:
        raise ImportError(f"no module of {target!r} can be imported")
    yield ".".join(parts[:depth]), obj
    for i in range(depth, len(parts)):
        obj = getattr(obj, parts[i])
        yield ".".join(parts[: i + 1]), obj


def _refusal(target: str, allowed: tuple[str, ...]) -> str | None:
    """Why ``target`` may not be instantiated, or None."""
    if not target.startswith(allowed):
        return f"targets must start with one of {list(allowed)}"
    private = [part for part in target.split(".") if part.startswith("_")]
    if private:
        return f"private names ({', '.join(private)}) cannot be targets"
    try:
        for path, obj in _resolution(target):
            home = _home(obj)
            if home is None or not home.startswith(allowed):
                return f"{path!r} is {home.rstrip('.') if home else type(obj).__name__!r}, outside {list(allowed)}"
    except (ImportError, AttributeError) as exc:
        return f"it cannot be resolved ({type(exc).__name__}: {exc})"
    return None


def check_targets(node: Any, extra_allowed: Sequence[str] = (), *, where: str = "") -> None:
    """Raise ``DisallowedTargetError`` naming the config key of the first target outside the allow-list."""
    allowed = tuple(DEFAULT_ALLOWED_PREFIXES) + tuple(extra_allowed)
    for key, target in _iter_targets(node, where):
        reason = _refusal(target, allowed)
        if reason is not None:
            raise DisallowedTargetError(
                f"{key}._target_={target!r} is not allowed: {reason}. "
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
