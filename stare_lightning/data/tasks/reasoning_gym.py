"""reasoning-gym generators as a record source (``data=reasoning_gym``), offline, scored by verifier ``reasoning_gym``.

``data.task`` names a generator (``basic_arithmetic``, ``chain_sum``, ...; ``generator_names()`` lists them
all) and ``data.task_kwargs`` holds its own settings, checked against its config class (``seed`` and ``size``
are ours to set). ``data.task=mixture`` draws from several generators through reasoning-gym's composite
dataset, each entry from one member chosen with probability proportional to its weight (on the command line
``data.task_kwargs`` takes a leading ``+``)::

    data.task=mixture +data.task_kwargs={datasets: {chain_sum: 2, leg_counting: 1}}
    data.task=mixture +data.task_kwargs={datasets: {chain_sum: {weight: 2, config: {max_terms: 3}}, leg_counting: 1}}

``data.task_kwargs.compact: true`` (our key, not the generator's) renders only the arithmetic expression,
``"4-1-7="``, for the generators in ``COMPACT_GENERATORS`` (spaces removed), a prompt the built-in tiny
character model can learn.

Splits: one generator (or composite) seeded with ``data.seed``; entry ``i`` is reasoning-gym's
``Random(seed + i)`` draw. Validation takes the first ``val_size`` distinct questions from index 0 on,
training the indices after the last of them, skipping every question that is also a validation question
(so the splits are disjoint both by index and by content; training may repeat its own questions).

Records: the question (or the compact expression) is the plain prompt, or one user message asking for the
answer within ``\\boxed{}`` (instruct); ``answer`` is the entry's answer (``""`` for generators without a
single oracle answer, which then have no supervised cold start). ``metadata`` holds ``data_source`` (the
generator, also inside a mixture), ``solution`` (the answer, for ``sft_examples``) and, under
``reasoning_gym``, what the verifier needs to rebuild the entry; reasoning-gym metadata is converted to
JSON by ``jsonable``. For each generator the first entry of every build is scored with its oracle answer
on the converted entry, through the verifier's own code, and must score as on the original entry.
"""

from __future__ import annotations

import dataclasses
import datetime
import difflib
import enum
import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

from ...config.checks import flag, number
from ...rewards.reasoning_gym import METADATA_KEY, score_entry
from ..records import PromptRecord

VERIFIER = "reasoning_gym"
MIXTURE = "mixture"
# Generators whose entries carry the bare arithmetic expression in metadata["expression"] (rg's
# countdown does too, but there it is the answer).
COMPACT_GENERATORS = ("basic_arithmetic", "chain_sum", "decimal_chain_sum", "products")
_OURS = ("seed", "size")
_EXAMPLES = ("basic_arithmetic", "chain_sum", "products", "leg_counting", "gcd", "spell_backward")
_LIST_HINT = (
    'all of them: python -c "from stare_lightning.data.tasks.reasoning_gym import generator_names as g; print(*g())"'
)


@dataclasses.dataclass(frozen=True)
class Member:
    """One generator of a source: its name, mixture weight and settings (plain JSON)."""

    name: str
    weight: float
    config: dict


@dataclasses.dataclass(frozen=True)
class GymSource:
    """The validated ``data.task`` / ``data.task_kwargs`` of a reasoning-gym source."""

    task: str
    members: tuple[Member, ...]
    compact: bool

    @property
    def is_mixture(self) -> bool:
        return self.task == MIXTURE


def _registry() -> dict:
    try:
        from reasoning_gym.factory import DATASETS
    except ImportError as exc:
        raise ValueError(
            f"data.source=reasoning_gym needs the reasoning-gym package ({exc}); install it with "
            "pip install 'stare_lightning[reasoning_gym]' (reasoning-gym==0.1.25)"
        ) from None
    return DATASETS


def import_rg():
    _registry()
    import reasoning_gym

    return reasoning_gym


def generator_names() -> list[str]:
    """Every reasoning-gym generator ``data.task`` may name (the composite is ``mixture``)."""
    return sorted(name for name in _registry() if name != "composite")


def _key(key: Any) -> str:
    """A dict key as ``json.dumps`` writes it (``1`` -> ``"1"``, ``True`` -> ``"true"``), other keys ``str``."""
    if isinstance(key, str):
        return str(key)
    if key is None or isinstance(key, (bool, int, float)):
        return json.dumps(key)
    return str(key)


def jsonable(value: Any) -> Any:
    """``value`` as plain JSON: tuples and sets become lists, numpy scalars and arrays Python values, dict
    keys strings, enums their values, dates ISO strings, NaN / infinities and any other object ``str``."""
    if value is None or type(value) in (bool, int, str):
        return value
    if isinstance(value, enum.Enum):
        return jsonable(value.value)
    if isinstance(value, float):  # numpy.float64 too
        return float(value) if math.isfinite(value) else str(value)
    if isinstance(value, str):  # numpy.str_
        return str(value)
    if isinstance(value, int):
        return bool(value) if isinstance(value, bool) else int(value)
    if isinstance(value, Mapping):
        return {_key(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted((jsonable(v) for v in value), key=lambda v: json.dumps(v, sort_keys=True))
    if isinstance(value, (datetime.date, datetime.time)):
        return value.isoformat()
    if type(value).__module__ == "numpy" and hasattr(value, "tolist"):
        return jsonable(value.tolist())
    if isinstance(value, Sequence) and not isinstance(value, (bytes, bytearray)):
        return [jsonable(v) for v in value]  # OmegaConf ListConfig and other sequences
    return str(value)


def _check_name(name: Any, key: str) -> None:
    names = generator_names()
    if name in names:
        return
    close = difflib.get_close_matches(str(name), names, n=3)
    hint = f"did you mean {', '.join(close)}? " if close else ""
    raise ValueError(
        f"{key}={name!r} is not a reasoning-gym generator; {hint}for example {', '.join(_EXAMPLES)}, "
        f"or {MIXTURE} for a weighted mix ({_LIST_HINT})"
    )


def _check_config(name: str, config: dict, key: str) -> None:
    """Unknown keys and settings the generator's own validation refuses fail here, naming ``key``."""
    config_cls = _registry()[name][1]
    allowed = [f.name for f in dataclasses.fields(config_cls) if f.name not in _OURS]
    ours = sorted(set(config) & set(_OURS))
    if ours:
        raise ValueError(
            f"{key}: {ours} cannot be set for generator {name!r}: the seed comes from data.seed and the "
            "size from data.train_size / data.val_size"
        )
    unknown = sorted(set(config) - set(allowed))
    if unknown:
        raise ValueError(f"{key}: unknown keys {unknown} for reasoning-gym generator {name!r}; it takes: {allowed}")
    try:
        import_rg().create_dataset(name, seed=0, size=1, **config)
    except Exception as exc:  # AssertionError, ValueError, TypeError...: the generator's own validation
        raise ValueError(
            f"{key}: reasoning-gym generator {name!r} refuses these settings {config}: {type(exc).__name__}: {exc}"
        ) from None


def _member(name: Any, spec: Any) -> Member:
    key = f"data.task_kwargs.datasets.{name}"
    _check_name(name, key)
    if isinstance(spec, Mapping):
        unknown = sorted(set(spec) - {"weight", "config"})
        if unknown:
            raise ValueError(f"{key}: unknown keys {unknown}; allowed: ['weight', 'config'] (settings go in config)")
        weight, config = spec.get("weight", 1.0), spec.get("config", {})
    else:
        weight, config = spec, {}
    number(f"{key}.weight" if isinstance(spec, Mapping) else key, weight, low=0.0, low_open=True)
    if not isinstance(config, Mapping):
        raise ValueError(f"{key}.config={config!r} is not allowed: must be a mapping of generator settings")
    config = jsonable(config)
    _check_config(name, config, f"{key}.config")
    return Member(name, float(weight), config)


def parse_source(task: Any, task_kwargs: Mapping[str, Any] | None = None) -> GymSource:
    """Validate ``data.task`` and ``data.task_kwargs`` of a reasoning-gym source; ValueError naming the key."""
    kwargs = jsonable(dict(task_kwargs or {}))
    compact = kwargs.pop("compact", False)
    flag("data.task_kwargs.compact", compact)
    if task == "composite":
        raise ValueError("data.task='composite': write data.task=mixture data.task_kwargs={datasets: {name: weight}}")
    if task == MIXTURE:
        datasets = kwargs.pop("datasets", None)
        if kwargs:
            raise ValueError(
                f"data.task_kwargs: unknown keys {sorted(kwargs)} for data.task=mixture; allowed: ['datasets', "
                "'compact'] (a member's settings go in datasets.<name>.config)"
            )
        if not isinstance(datasets, dict) or not datasets:
            raise ValueError(
                f"data.task_kwargs.datasets={datasets!r} is not allowed: data.task=mixture needs a mapping of "
                "generator names to weights, e.g. {chain_sum: 2, leg_counting: 1}"
            )
        members = tuple(_member(name, spec) for name, spec in datasets.items())
    else:
        _check_name(task, "data.task")
        _check_config(task, kwargs, "data.task_kwargs")
        members = (Member(task, 1.0, kwargs),)
    if compact:
        bad = [m.name for m in members if m.name not in COMPACT_GENERATORS]
        if bad:
            raise ValueError(
                f"data.task_kwargs.compact=true needs generators whose entries are bare arithmetic expressions "
                f"({', '.join(COMPACT_GENERATORS)}); not {bad}"
            )
    return GymSource(task, members, compact)


def _dataset(source: GymSource, seed: int, size: int) -> tuple[Any, dict[str, int]]:
    """The generator (or composite) of ``source`` and the seed each member generator was built with."""
    rg = import_rg()
    size = max(1, size)
    if not source.is_mixture:
        member = source.members[0]
        dataset = rg.create_dataset(member.name, seed=seed, size=size, **member.config)
        return dataset, {member.name: dataset.seed}
    from reasoning_gym.composite import DatasetSpec

    specs = [DatasetSpec(name=m.name, weight=m.weight, config=dict(m.config)) for m in source.members]
    dataset = rg.create_dataset("composite", seed=seed, size=size, datasets=specs)
    return dataset, {name: sub.seed for name, sub in dataset.datasets.items()}


def _question(entry: dict, compact: bool, name: str) -> str:
    if not compact:
        return entry["question"]
    expression = entry["metadata"].get("expression")
    if not isinstance(expression, str) or not expression:
        raise ValueError(f"data.task_kwargs.compact=true: generator {name!r} gave an entry without an expression")
    return expression.replace(" ", "") + "="


def _draw(dataset, source: GymSource, start: int, count: int, skip: set, distinct: bool) -> tuple[list, int]:
    """``count`` (index, entry, question) from index ``start`` on, skipping ``skip`` questions (and repeats
    when ``distinct``); also the index after the last one taken."""
    taken, index, misses = [], start, 0
    while len(taken) < count:
        try:
            entry = dataset[index]
        except IndexError as exc:
            raise ValueError(
                f"reasoning-gym {source.task!r}: no entry {index} ({exc}); lower data.train_size"
            ) from None
        index += 1
        name = entry["metadata"].get("source_dataset", source.members[0].name)
        question = _question(entry, source.compact, name)
        if question in skip:
            misses += 1
            if misses > 1000 + 100 * count:
                raise ValueError(
                    f"reasoning-gym {source.task!r}: only {len(taken)} of {count} questions found outside the "
                    f"{len(skip)} already taken (the generator's problem space is too small); lower data.val_size "
                    "or widen the generator's settings"
                )
            continue
        if distinct:
            skip.add(question)
        taken.append((index - 1, entry, question))
    return taken, index


def _record(source: GymSource, split: str, i: int, drawn: tuple, style: str, seeds: dict) -> PromptRecord:
    index, entry, question = drawn
    name = entry["metadata"].get("source_dataset", source.members[0].name)
    if name not in seeds:
        raise ValueError(f"reasoning-gym {source.task!r}: entry {index} names unknown generator {name!r}")
    member = next(m for m in source.members if m.name == name)
    answer = entry["answer"]
    info = {
        "generator": name,
        "config": member.config,
        "seed": seeds[name],
        "index": index,
        "answer": None if answer is None else str(answer),
        "metadata": jsonable(entry["metadata"]),
    }
    metadata = {"task": source.task, "style": style, "data_source": name, METADATA_KEY: info}
    if answer is not None:
        metadata["solution"] = str(answer)
    rid = f"rg-{source.task}-{split}-{i}"
    text = "" if answer is None else str(answer)
    if style == "plain":
        return PromptRecord(rid, question, None, text, VERIFIER, metadata)
    messages = [{"role": "user", "content": f"{question}\n\nPut your final answer within \\boxed{{}}."}]
    return PromptRecord(rid, None, messages, text, VERIFIER, metadata)


def _check_roundtrip(dataset, drawn: list, records: list[PromptRecord]) -> None:
    """The first entry of each generator with an oracle answer scores the same on its stored (JSON) form."""
    seen: set = set()
    for (_, entry, _), record in zip(drawn, records):
        info = record.metadata[METADATA_KEY]
        if info["generator"] in seen or entry["answer"] is None:
            continue
        seen.add(info["generator"])
        original = dataset.score_answer(entry["answer"], entry)
        stored = score_entry(info, info["answer"])
        if stored != original:
            raise ValueError(
                f"reasoning-gym generator {info['generator']!r}: its oracle answer scores {stored} on the stored "
                f"(JSON) entry but {original} on the original; this generator cannot be used here"
            )


def make_records(
    source: GymSource, split: str, size: int, *, style: str, seed: int, val_size: int
) -> list[PromptRecord]:
    """``size`` training or ``val_size`` validation records of ``source`` (from ``parse_source``)."""
    dataset, seeds = _dataset(source, seed, val_size + (size if split == "train" else 0))
    questions: set = set()
    val, after_val = _draw(dataset, source, 0, val_size, questions, distinct=True)
    drawn = val if split == "val" else _draw(dataset, source, after_val, size, questions, distinct=False)[0]
    records = [_record(source, split, i, d, style, seeds) for i, d in enumerate(drawn)]
    _check_roundtrip(dataset, drawn, records)
    return records
