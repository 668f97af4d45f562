"""Every key of the run's schema with its type, schema default, value in the default run, allowed values and meaning.

The documentation's configuration reference is generated from this, so it cannot drift from the code: the meaning
is the attribute docstring written under each dataclass field, the allowed values are what the schema's own checks
(``config/checks.py``) note while they run, and the defaults are read from the dataclasses and from the composed
``conf/config.yaml``. ``python -m stare_lightning.config_reference`` prints the keys as a table.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
import textwrap
import types
import typing
from dataclasses import dataclass
from typing import Any

from omegaconf import OmegaConf

from stare_lightning.config.checks import recorded_rules

__all__ = ["ConfigKey", "attribute_docs", "checked_rules", "config_keys", "show"]

_INDEX = re.compile(r"\[\d+\]")


@dataclass(frozen=True)
class ConfigKey:
    """One key of the schema. ``key`` is dotted; ``[]`` stands for any entry of a list of mappings."""

    key: str
    type: str
    default: str  # the schema's default, as YAML spells it
    in_default_run: str | None  # the value `python -m stare_lightning fit` runs with (None: not a plain value)
    allowed: str  # what the checks allow ("" where only the type is checked)
    doc: str
    group: bool  # a nested group of keys (its own keys follow)
    owner: str  # the dataclass that declares it


def attribute_docs(cls: type) -> dict[str, str]:
    """``field -> docstring`` for the string literal written right under each annotated field of ``cls``."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for statement, following in zip(body, body[1:]):
        literal = following.value if isinstance(following, ast.Expr) else None
        if (
            isinstance(statement, ast.AnnAssign)
            and isinstance(statement.target, ast.Name)
            and isinstance(literal, ast.Constant)
            and isinstance(literal.value, str)
        ):
            docs[statement.target.id] = " ".join(literal.value.split())
    return docs


def show(value: Any) -> str:
    """A value as a user writes it in YAML or on the command line."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(show(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {show(v)}" for k, v in value.items()) + "}"
    if isinstance(value, float):
        return repr(value)
    return str(value)


def _type_name(hint: Any) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        names = [_type_name(a) for a in args if a is not type(None)]
        return " | ".join(names) + (" | null" if type(None) in args else "")
    if origin in (list, tuple):
        return f"list[{', '.join(_type_name(a) for a in args)}]" if args else "list"
    if origin is dict or hint is dict:
        return "mapping"
    if hint is Any:
        return "any"
    if dataclasses.is_dataclass(hint):
        return "group"
    return getattr(hint, "__name__", str(hint))


def _nested(hint: Any) -> tuple[type | None, bool]:
    """The dataclass a field holds (directly, optionally or as list entries) and whether it is a list of them."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if dataclasses.is_dataclass(hint):
        return hint, False
    if origin in (typing.Union, types.UnionType):
        for arg in args:
            if dataclasses.is_dataclass(arg):
                return arg, False
    if origin is list and args and dataclasses.is_dataclass(args[0]):
        return args[0], True
    return None, False


def _default(field: dataclasses.Field) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return None


def _probe(hint: Any) -> Any:
    """A value of the field's type, to make the schema run the checks it runs only on a set value."""
    names = _type_name(hint).replace(" | null", "")
    return {"int": 1, "float": 1.0, "str": "probe", "bool": True}.get(names)


def _walk(cls: type, prefix: str, visit) -> None:
    hints = typing.get_type_hints(cls)
    docs = attribute_docs(cls)
    for field in dataclasses.fields(cls):
        key = f"{prefix}{field.name}"
        nested, is_list = _nested(hints[field.name])
        visit(cls, field, key, hints[field.name], docs.get(field.name, ""), nested)
        if nested is not None:
            _walk(nested, f"{key}[]." if is_list else f"{key}.", visit)


def checked_rules() -> dict[str, str]:
    """``key -> what its check allows``, recorded while the schema validates the default run, each group's own
    defaults, and each optional field set to a value (list indices shown as ``[]``)."""
    from stare_lightning.cli import compose
    from stare_lightning.run_config import RunConfig, to_run_config

    constructions = [lambda: to_run_config(compose([]))]

    def collect(cls, field, key, hint, doc, nested):
        if nested is not None:
            constructions.append(nested)
            probe = {f.name: _probe(h) for f, h in _fields_with_hints(nested) if _probe(h) is not None}
            if typing.get_origin(hint) is list:  # entries are checked by their parent, e.g. data.val_sets
                constructions.append(lambda: cls(**{field.name: [probe]}))
        if _default(field) is None and _probe(hint) is not None:
            constructions.append(lambda: cls(**{field.name: _probe(hint)}))

    _walk(RunConfig, "", collect)
    with recorded_rules() as rules:
        for build in constructions:
            try:
                build()
            except (ValueError, TypeError):  # a probe value may be refused: its rule is noted before the refusal
                pass
    merged: dict[str, str] = {}
    for key, rule in rules.items():
        plain = _INDEX.sub("[]", key)
        if plain.endswith("[]"):  # an entry of a list of values: the rule of each entry
            plain, rule = plain[:-2], f"each: {rule}"
        merged.setdefault(plain, rule)
    return merged


def _fields_with_hints(cls: type) -> list[tuple[dataclasses.Field, Any]]:
    hints = typing.get_type_hints(cls)
    return [(f, hints[f.name]) for f in dataclasses.fields(cls)]


def config_keys() -> list[ConfigKey]:
    """Every key of ``RunConfig``, groups before their keys, in declaration order."""
    from stare_lightning.cli import compose
    from stare_lightning.run_config import RunConfig

    default_run = compose([])
    rules = checked_rules()
    keys: list[ConfigKey] = []

    def add(cls, field, key, hint, doc, nested):
        value = None
        if "[]" not in key and nested is None:
            node = OmegaConf.select(default_run, key, throw_on_missing=False)
            if node is not None or OmegaConf.select(default_run, key, default="<absent>") is None:
                value = OmegaConf.to_container(node, resolve=False) if OmegaConf.is_config(node) else node
                value = show(value)
        default = "" if nested is not None and typing.get_origin(hint) is not list else show(_default(field))
        keys.append(
            ConfigKey(
                key=key,
                type=_type_name(hint),
                default=default,
                in_default_run=value,
                allowed=rules.get(key, ""),
                doc=doc,
                group=nested is not None,
                owner=f"{cls.__module__}.{cls.__qualname__}",
            )
        )

    _walk(RunConfig, "", add)
    return keys


def main() -> None:
    for item in config_keys():
        if not item.group:
            print(f"{item.key:<45} {item.type:<14} {item.default:<20} {item.allowed}")


if __name__ == "__main__":
    main()
