"""Package namespaces that import their members on first use (PEP 562).

A package's ``__init__`` names what it offers (``from stare_lightning.step import micro_batch_loss``) without
importing it: the config schemas sit inside the packages they configure, and importing a schema must not load
torch, Lightning or transformers with the package's implementations (``run_config`` is read before anything heavy
runs). A name is imported from its module the first time it is asked for, then kept in the package.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping, Sequence

__all__ = ["lazy_exports"]


def lazy_exports(
    package: str, exports: Mapping[str, Sequence[str]]
) -> tuple[Callable[[str], object], Callable[[], list], list[str]]:
    """``(__getattr__, __dir__, __all__)`` for ``package``, which offers the names ``exports[module]`` of each of its
    modules (``module`` absolute, or relative to the package). A name may not be one of the package's submodules:
    importing that submodule would replace the name with the module."""
    home: dict[str, str] = {}
    for module, names in exports.items():
        for name in names:
            if name in home:
                raise ValueError(f"{package} exports {name!r} from both {home[name]} and {module}")
            home[name] = module

    def __getattr__(name: str) -> object:
        module = home.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module, package), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(home) | set(vars(sys.modules[package])))

    return __getattr__, __dir__, sorted(home)
