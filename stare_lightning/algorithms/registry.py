"""Named implementations of the loss's pluggable parts: advantage estimators, policy losses, entropy controls.

Each part is a ``Registry``; an implementation is a function registered under the name its config key takes
(``algorithm.advantage.name``, ``algorithm.policy_loss.name``, ``algorithm.entropy_control.name``,
``algorithm.stare.selector``). Adding one is the function, its ``@REGISTRY.register("name")`` line, and a YAML
file in ``conf/algorithm`` that selects it: the config check and the dispatch read the registry, so nothing else
changes. An entry with settings of its own reads them from its node of the sub-group (e.g.
``algorithm.entropy_control.clip_cov``), whose schema (a ``*Settings`` dataclass) sits with the other sub-groups in
``algorithms/config_groups.py``, so that reading the schema imports no implementation.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

Fn = TypeVar("Fn", bound=Callable)

__all__ = ["Registry"]


class Registry(Generic[Fn]):
    def __init__(self, key: str) -> None:
        self.key = key  # the config key that names an entry, for error messages
        self._entries: dict[str, Fn] = {}

    def register(self, name: str) -> Callable[[Fn], Fn]:
        def add(fn: Fn) -> Fn:
            if name in self._entries:
                first = getattr(self._entries[name], "__qualname__", self._entries[name])
                raise ValueError(f"{self.key}: {name!r} is registered twice ({first})")
            self._entries[name] = fn
            return fn

        return add

    def names(self) -> tuple[str, ...]:
        return tuple(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __getitem__(self, name: str) -> Fn:
        if name not in self._entries:
            raise ValueError(f"{self.key}={name!r} is not allowed: choose one of [{', '.join(self._entries)}]")
        return self._entries[name]
