"""A composition that fails on an unknown key or a wrongly typed value, told in this project's words, on one line.

Hydra answers a misspelled key with advice that points the wrong way (``To append to your config use +key=...``:
adding a key the schema does not have fails later, or is silently ignored) and a wrong type with only ``Error
merging override``. ``in_our_words`` reads the OmegaConf error underneath and says instead:

- for an unknown key, the closest known keys of its group (``did you mean algorithm.stare.w?``), or all of them;
- for an unknown top-level name, which may be a misspelled group (``algoritm=grpo_ds``), the groups and the
  top-level keys;
- for a value of the wrong type, the key, the type it needs and the value given.

The known keys are those of the configuration the other overrides compose, so a group's option counts (the keys
of ``trainer=fsdp`` are not those of ``trainer=cpu``).
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from collections.abc import Callable, Sequence
from pathlib import Path

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException, ValidationError
from omegaconf.nodes import AnyNode, BooleanNode, EnumNode, FloatNode, IntegerNode, StringNode

__all__ = ["CONSTRUCTOR_GROUPS", "config_groups", "in_our_words", "unknown_key_error", "unknown_schema_key"]

# Groups whose entries are constructor calls (``_target_`` mappings): an argument an option file leaves unset may be
# added with a leading ``+``, so there (and only there) that is worth saying.
CONSTRUCTOR_GROUPS = ("trainer", "callbacks", "logger")

_NODE_TYPES = {
    FloatNode: "a float",
    IntegerNode: "an integer",
    BooleanNode: "a boolean (true or false)",
    StringNode: "a string",
    AnyNode: "any value",
}


def config_groups(conf_dir: str | Path) -> list[str]:
    """The config groups: the folders of ``conf/`` (each holds the options a ``group=option`` override picks)."""
    return sorted(path.name for path in Path(conf_dir).iterdir() if path.is_dir() and any(path.glob("*.yaml")))


def _omegaconf_cause(error: BaseException) -> OmegaConfBaseException | None:
    """The first OmegaConf error with a key in ``error``'s chain of causes."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, OmegaConfBaseException) and getattr(seen, "full_key", None):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def _override_of(full_key: str, overrides: Sequence[str]) -> str | None:
    """The override that sets ``full_key`` or a key below it."""
    for override in overrides:
        key = override.partition("=")[0].lstrip("+~")
        if key == full_key or key.startswith(full_key + "."):
            return override
    return None


def _type_needed(node) -> str:
    if isinstance(node, DictConfig):
        return "a group of keys (set them one by one, KEY.NAME=value)"
    if isinstance(node, ListConfig):
        return "a list, e.g. [a,b]"
    if isinstance(node, EnumNode):
        return "one of " + ", ".join(member.name for member in node.enum_type)
    needed = next((name for kind, name in _NODE_TYPES.items() if isinstance(node, kind)), type(node).__name__)
    optional = getattr(node, "_is_optional", lambda: False)()
    return f"{needed} or null" if optional else needed


def _wrong_type(cause: ValidationError, where: str) -> ValueError:
    key = cause.full_key
    needed = _type_needed(getattr(cause, "child_node", None))
    return ValueError(f"{key} takes {needed}, not {cause.value!r} ({where})")


def _known_keys(parent: str, others: Sequence[str], compose: Callable[[Sequence[str]], DictConfig]) -> list[str]:
    """The keys under ``parent`` in the configuration the other overrides compose (the default one where those
    fail too)."""
    for overrides in (others, ()):
        try:
            node = OmegaConf.select(compose(overrides), parent) if parent else compose(overrides)
        except Exception:  # noqa: BLE001 - another bad override: fall back to the default configuration
            continue
        if isinstance(node, DictConfig):
            return [str(key) for key in node.keys()]
    return []


def _unknown_key(full_key: str, where: str, known: list[str], groups: list[str]) -> ValueError:
    parent, _, name = full_key.rpartition(".")
    if not parent:  # a top-level name: a misspelled group as likely as a misspelled key
        candidates = sorted({*groups, *known} - {"hydra"})
        close = difflib.get_close_matches(name, candidates, n=3, cutoff=0.6)
        guess = f"did you mean {' or '.join(close)}? " if close else ""
        keys = ", ".join(k for k in known if k not in groups and k != "hydra")
        return ValueError(
            f"{name} is neither a config group nor a key ({where}): {guess}the groups (group=option) are "
            f"{', '.join(groups)}; the other top-level keys are {keys}"
        )
    close = difflib.get_close_matches(name, known, n=3, cutoff=0.6)
    if close:
        return ValueError(
            f"{full_key} is not a key of {parent} ({where}): did you mean "
            f"{' or '.join(f'{parent}.{key}' for key in close)}?"
        )
    message = f"{full_key} is not a key of {parent} ({where}); its keys are {', '.join(known) or 'none'}"
    if parent.split(".")[0] in CONSTRUCTOR_GROUPS and where.startswith("override '"):
        added = where.removeprefix("override '").removesuffix("'").lstrip("+~")
        message += f"; to pass an argument the option file leaves unset, add it: +{added}"
    return ValueError(message)


def _extra_fields(node: DictConfig) -> list[str]:
    """The keys of ``node`` that its schema dataclass has no field for (none where it has no dataclass)."""
    schema = OmegaConf.get_type(node)
    if not dataclasses.is_dataclass(schema):
        return []
    fields = {field.name for field in dataclasses.fields(schema)}
    return [str(key) for key in node.keys() if key not in fields and key != "hydra"]


def unknown_schema_key(cfg: DictConfig, prefix: str = "") -> str | None:
    """The first key of ``cfg`` that sits in a group of the typed schema without being one of its fields (a key
    added with ``+``, which composition lets through and the run's schema refuses later), or None."""
    extra = _extra_fields(cfg) if not prefix else []
    if extra:
        return extra[0]
    for key in cfg.keys():
        if not prefix and key == "hydra":  # Hydra's own node: not the run's schema
            continue
        node = cfg._get_node(key)
        if not isinstance(node, DictConfig) or node._is_none() or node._is_missing():
            continue
        full_key = f"{prefix}{key}"
        extra = _extra_fields(node)
        if extra:
            return f"{full_key}.{extra[0]}"
        found = unknown_schema_key(node, f"{full_key}.")
        if found:
            return found
    return None


def unknown_key_error(
    full_key: str, overrides: Sequence[str], compose: Callable[[Sequence[str]], DictConfig], groups: list[str]
) -> ValueError:
    """The one line for ``full_key``, a key the schema does not have (see ``in_our_words``)."""
    override = _override_of(full_key, overrides)
    where = f"override {override!r}" if override else "set in a config file"
    others = [o for o in overrides if o != override]
    return _unknown_key(full_key, where, _known_keys(full_key.rpartition(".")[0], others, compose), groups)


def in_our_words(
    error: BaseException,
    overrides: Sequence[str],
    compose: Callable[[Sequence[str]], DictConfig],
    groups: list[str],
) -> ValueError | None:
    """One line for a composition that failed on an unknown key or a wrong type (None for any other failure).

    ``compose`` builds a configuration from overrides (to find the keys that do exist); ``groups`` are the config
    groups (``config_groups``)."""
    cause = _omegaconf_cause(error)
    if cause is None:
        return None
    full_key = str(cause.full_key)
    if isinstance(cause, ValidationError) and getattr(cause, "child_node", None) is not None:
        override = _override_of(full_key, overrides)
        return _wrong_type(cause, f"override {override!r}" if override else "set in a config file")
    if isinstance(cause, (ConfigAttributeError, ConfigKeyError)):
        entry = getattr(cause, "object_type", None)
        if _override_of(full_key, overrides) is None and dataclasses.is_dataclass(entry) and "." not in full_key:
            return _unknown_entry_key(full_key, entry, overrides)
        return unknown_key_error(full_key, overrides, compose, groups)
    return None


def _unknown_entry_key(key: str, entry: type, overrides: Sequence[str]) -> ValueError:
    """An unknown key inside a list's entry (``data.val_sets=[{name: a, nn: 1}]``): OmegaConf names the key alone,
    so the entry's type and the override that mentions the key say where."""
    fields = [field.name for field in dataclasses.fields(entry)]
    override = next((o for o in overrides if re.search(rf"\b{re.escape(key)}\s*:", o)), None)
    where = f"override {override!r}" if override else "set in a config file"
    close = difflib.get_close_matches(key, fields, n=3, cutoff=0.6)
    known = f"did you mean {' or '.join(close)}?" if close else f"its keys are {', '.join(fields)}"
    return ValueError(f"{key} is not a key of a {entry.__name__} entry ({where}): {known}")
