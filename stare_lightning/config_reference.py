"""Every key of the run's schema with its type, schema default, value in the default run, allowed values and meaning.

The documentation's configuration reference is generated from this, so it cannot drift from the code: the meaning
is the attribute docstring written under each dataclass field, the allowed values are what the schema's own checks
(``config/checks.py``) note while they run, and the defaults are read from the dataclasses and from the composed
``conf/config.yaml``. ``python -m stare_lightning.config_reference`` prints the keys as a table.

The ``trainer``, ``callbacks`` and ``logger`` groups are constructor calls (``_target_`` mappings), not schema
dataclasses: ``constructor_keys`` lists every key their option files set, with the value each option gives it and
the meaning from the ``Args:`` section of the docstring of the class it is passed to (Lightning's own, for the
Trainer and Lightning's callbacks and loggers), followed by the option file's comment on the line where one exists.
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

__all__ = [
    "CONSTRUCTOR_GROUPS",
    "ConfigKey",
    "ConstructorKey",
    "argument_docs",
    "attribute_docs",
    "checked_rules",
    "config_keys",
    "constructor_keys",
    "show",
]

CONSTRUCTOR_GROUPS = ("trainer", "callbacks", "logger")

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


@dataclass(frozen=True)
class ConstructorKey:
    """One key of a constructor group (``trainer``, ``callbacks``, ``logger``), over all of the group's options."""

    key: str  # dotted, e.g. ``trainer.strategy.param_dtype`` or ``callbacks.entropy_guard.low``
    target: str  # the class the key's value is passed to (for ``_target_``: the class it names)
    values: dict[str, str]  # option file -> the value it sets, as YAML spells it (options that leave it unset: absent)
    in_default_run: str | None  # the value `python -m stare_lightning fit` composes (None: not set there)
    doc: str


_ARGUMENT = re.compile(r"(\*{0,2}\w+)(?:\s*\([^)]*\))?:\s*(.*)")
_ROLE = re.compile(r":(?:class|func|meth|attr|paramref|obj|mod):`~?([^`]+)`")
_LINK = re.compile(r"`([^`<]+?)\s*<[^>]+>`_")


def _plain(text: str) -> str:
    """Docstring markup as Markdown: roles to the name they point at, RST links to their text, RST literals to code
    spans."""
    text = _ROLE.sub(lambda match: f"`{match[1].rsplit('.', 1)[-1]}`", text)
    text = _LINK.sub(lambda match: match[1], text)
    return " ".join(text.replace("``", "`").split())


def argument_docs(cls: type) -> dict[str, str]:
    """``argument -> meaning`` from the ``Args:`` sections of ``cls``'s docstrings (the class's and its
    ``__init__``'s, then those of its bases: a subclass that adds nothing documents nothing). The first paragraph
    of each entry only."""
    docs: dict[str, str] = {}
    for owner in inspect.getmro(cls):
        for text in (owner.__dict__.get("__doc__"), getattr(owner.__dict__.get("__init__"), "__doc__", None)):
            for name, meaning in _args_section(inspect.cleandoc(text or "")).items():
                docs.setdefault(name, meaning)
    return docs


def _args_section(text: str) -> dict[str, str]:
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.strip() in ("Args:", "Arguments:", "Parameters:")), None)
    if start is None:
        return {}
    outer = len(lines[start]) - len(lines[start].lstrip())
    entries: dict[str, list[str]] = {}
    indent, current, paragraph_done = None, None, False
    for line in lines[start + 1 :]:
        if not line.strip():
            paragraph_done = current is not None
            continue
        depth = len(line) - len(line.lstrip())
        if depth <= outer:
            break
        indent = depth if indent is None else indent
        match = _ARGUMENT.fullmatch(line.strip()) if depth == indent else None
        if match:
            current, paragraph_done = match[1].lstrip("*"), False
            entries[current] = [match[2]]
        elif current is not None and depth > indent and not paragraph_done:
            entries[current].append(line.strip())
    return {name: _plain(" ".join(parts)) for name, parts in entries.items()}


def yaml_comments(path, prefix: str) -> dict[str, str]:
    """``dotted key -> the comment on its line`` in one config file (mappings only; list items are skipped)."""
    found: dict[str, str] = {}
    stack: list[tuple[int, str]] = []  # (indent, name) of the mappings above the line
    for line in path.read_text().splitlines():
        match = re.match(r"( *)([\w-]+):([^#]*)(?:#\s*(.+))?$", line)
        if not match:
            continue
        indent = len(match[1])
        while stack and stack[-1][0] >= indent:
            stack.pop()
        key = ".".join([prefix, *(name for _, name in stack), match[2]])
        if match[4]:
            found[key] = match[4].strip()
        stack.append((indent, match[2]))
    return found


def _own_summary(cls: type | None) -> str:
    """The first paragraph of the class's own docstring (not one it inherits)."""
    own = (cls.__dict__.get("__doc__") if cls else None) or ""
    if not own.strip() and cls is not None:  # e.g. Lightning's Trainer documents itself in __init__
        own = getattr(cls.__dict__.get("__init__"), "__doc__", None) or ""
    return _plain(inspect.cleandoc(own).split("\n\n")[0])


def _constructor_rows(node: dict, prefix: str, owner: str | None, visit) -> None:
    """``visit(key, owner, value, nested)`` for every key under ``node``: the plain keys of a mapping with a
    ``_target_`` are arguments of that class; a mapping without one (callbacks and loggers by name) passes none."""
    arguments_of = node.get("_target_", owner)
    for name, value in node.items():
        key = f"{prefix}.{name}"
        nested = isinstance(value, dict) and bool(value)
        visit(key, arguments_of, value, nested)
        if nested:
            _constructor_rows(value, key, None, visit)


def _class(path: str | None) -> type | None:
    import hydra.utils

    return hydra.utils.get_class(path) if path else None


def constructor_keys() -> list[ConstructorKey]:
    """Every key that an option of ``trainer``, ``callbacks`` or ``logger`` sets, with each option's value."""
    from pathlib import Path

    from stare_lightning.cli import compose, config_dir

    conf = Path(config_dir())
    default_run = OmegaConf.to_container(compose([]), resolve=False)
    rows: dict[str, dict] = {}
    for group in CONSTRUCTOR_GROUPS:
        comments: dict[str, str] = {}
        for option in sorted((conf / group).glob("*.yaml")):
            for key, comment in yaml_comments(option, group).items():
                comments.setdefault(key, comment)
            node = OmegaConf.to_container(compose([f"{group}={option.stem}"])[group], resolve=False) or {}

            def visit(key, owner, value, nested, option=option.stem):
                row = rows.setdefault(key, {"owner": owner, "values": {}, "nested": nested})
                row["owner"] = row["owner"] or owner
                row["values"][option] = value.get("_target_", "") if nested else show(value)

            _constructor_rows(node, group, None, visit)
        for key, row in rows.items():
            if key.startswith(f"{group}.") and "comment" not in row:
                row["comment"] = comments.get(key, "")
    found = []
    for key, row in rows.items():
        name = key.rsplit(".", 1)[-1]
        if name == "_target_":
            targets = sorted(set(row["values"].values()))
            doc = " ".join(
                ["The class built.", *(f"`{t.rsplit('.', 1)[-1]}`: {_own_summary(_class(t))}" for t in targets)]
            )
        elif row["owner"] is None:  # a callback or logger by name
            kind = "callback" if key.startswith("callbacks.") else "logger"
            doc = f"The run's `{name}` {kind}, built from its `_target_` and the keys under it; null leaves it out."
        else:
            doc = argument_docs(_class(row["owner"])).get(name, "")
            if row["nested"]:
                doc = f"{doc} A class of its own: its `_target_` and arguments follow.".strip()
        if row["comment"]:
            doc = f"{doc} *Here: {row['comment']}.*".strip()
        value: Any = default_run
        for part in key.split("."):
            value = value.get(part, "<absent>") if isinstance(value, dict) else "<absent>"
        in_default_run = (
            None if value == "<absent>" else show(value.get("_target_") if isinstance(value, dict) else value)
        )
        found.append(ConstructorKey(key, row["owner"] or "", dict(row["values"]), in_default_run, doc))
    return found


def main() -> None:
    for item in config_keys():
        if not item.group:
            print(f"{item.key:<45} {item.type:<14} {item.default:<20} {item.allowed}")


if __name__ == "__main__":
    main()
