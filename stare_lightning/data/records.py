"""The prompt record schema and its loader (rows come from ``readers``: JSONL, JSON, Parquet, ``datasets``).

A record is one prompt with its reference answer and the name of the verifier that scores responses:

    {"id": "q1", "prompt": "What is 2+2?", "answer": "4", "verifier": "numeric", "metadata": {...}}

``messages`` (a chat: ``[{"role": "user", "content": ...}, ...]``) may replace ``prompt``; a ``prompt``
that is a list of messages is read as ``messages``. ``id`` defaults to ``<file name>:<line or row>``,
``verifier`` to ``default_verifier``, and keys outside the schema are kept in ``metadata`` (an explicit
``metadata`` object wins on a clash); of each chat message only ``role`` and ``content`` are kept.
``columns`` renames source fields, dotted paths reach into nested objects:
``{"prompt": "question", "answer": "reward_model.ground_truth"}``; a mapped column is read only under the
key it is mapped to. A file whose first row is in verl's layout (``VERL_COLUMNS``: ``prompt`` a message list,
``reward_model.ground_truth``, ``data_source``) is read as it is, ``data_source`` naming its benchmark.

Everything is checked while loading, before any training: malformed JSON (file and line), a missing
or empty prompt or answer (file, line/row and key), an unknown verifier (with the list of known ones),
a record its verifier could never score (e.g. a ``numeric`` answer that is not a number), duplicate ids.
Locations: JSONL ``line N`` (1-based, as in an editor); JSON ``item N`` and Parquet / datasets
``row N`` (0-based indices).

User verifiers (``package.module:function``) are accepted in records only when the caller allows them
(``default_verifier`` or ``user_verifiers``, i.e. the config), so a data file cannot pick code to run.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..rewards.registry import check_record, get_verifier, is_user_verifier_name, known_verifiers
from .readers import DataError, column_value, rows_of

SCHEMA_KEYS = ("id", "prompt", "messages", "answer", "verifier", "metadata")


@dataclass
class PromptRecord:
    """One prompt: exactly one of ``prompt`` (plain text) or ``messages`` (a chat) is set."""

    id: str
    prompt: str | None
    messages: list[dict] | None
    answer: str
    verifier: str
    metadata: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError(f"record {self.id!r}: exactly one of 'prompt' or 'messages' must be set")
        if self.prompt is not None and (not isinstance(self.prompt, str) or not self.prompt.strip()):
            raise ValueError(f"record {self.id!r}: 'prompt' must be a non-empty string")
        if self.messages is not None:
            problem = _messages_problem(self.messages)
            if problem:
                raise ValueError(f"record {self.id!r}: {problem}")
        if not isinstance(self.answer, str):
            raise ValueError(f"record {self.id!r}: 'answer' must be a string, got {type(self.answer).__name__}")
        if not isinstance(self.verifier, str) or not self.verifier:
            raise ValueError(f"record {self.id!r}: 'verifier' must be a non-empty string")
        if not isinstance(self.metadata, dict):
            raise ValueError(f"record {self.id!r}: 'metadata' must be a dict")

    @property
    def is_chat(self) -> bool:
        return self.messages is not None


def _messages_problem(messages: Any) -> str | None:
    if not isinstance(messages, (list, tuple)) or not messages:
        return "'messages' must be a non-empty list of {'role', 'content'} objects"
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            return f"messages[{i}] must be an object with 'role' and 'content', got {type(m).__name__}"
        for key in ("role", "content"):
            if not isinstance(m.get(key), str):
                return f"messages[{i}] needs a string {key!r}"
        if not m["role"].strip():
            return f"messages[{i}] has an empty 'role'"
    return None


# --------------------------------------------------------------------------------------------------
# Raw rows -> records
# --------------------------------------------------------------------------------------------------


# verl's RL parquet layout (also the STARE reference code's): ``prompt`` a message list, the answer in
# ``reward_model.ground_truth``, ``data_source`` (the benchmark), ``ability``, ``extra_info`` (kept as metadata).
VERL_COLUMNS = {"messages": "prompt", "answer": "reward_model.ground_truth"}


def is_verl_row(row: Any) -> bool:
    """True for a row in verl's layout that has no schema ``answer`` of its own."""
    if not isinstance(row, Mapping) or "answer" in row:
        return False
    reward_model = row.get("reward_model")
    return isinstance(reward_model, Mapping) and "ground_truth" in reward_model and "prompt" in row


class _VerifierNames:
    """Checks verifier names once each, with the caller's allow-list for user functions; ``default``: the verifier of
    records that name none."""

    def __init__(self, default_verifier: str | None, user_verifiers: Sequence[str]) -> None:
        self.default = default_verifier
        self.allowed_user = {v for v in (default_verifier, *user_verifiers) if v and is_user_verifier_name(v)}
        self.ok: set = set()

    def check(self, name: str) -> str | None:
        """None when ``name`` is usable, else the problem."""
        if name in self.ok:
            return None
        if is_user_verifier_name(name) and name not in self.allowed_user:
            return (
                f"verifier {name!r} is a user function that the config does not name; "
                "list it in data.user_verifiers (or set it as data.default_verifier) to allow it. "
                f"Known verifiers: {', '.join(known_verifiers())}"
            )
        try:
            get_verifier(name)
        except ValueError as exc:
            return str(exc)
        self.ok.add(name)
        return None


def _build_record(
    row: Any,
    *,
    source: str,
    where: str,
    auto_id: str,
    names: _VerifierNames,
    columns: Mapping[str, str],
) -> PromptRecord:
    def fail(problem: str) -> DataError:
        return DataError(f"{source}, {where}: {problem}")

    if not isinstance(row, Mapping):
        raise fail(f"expected an object with keys {list(SCHEMA_KEYS)}, got {type(row).__name__}")
    values, used = _mapped_values(row, columns, fail)
    prompt, messages = _prompt_or_messages(values, row, fail)
    answer = _answer(values, row, fail)
    verifier = _verifier(values, names, fail)
    metadata = values.get("metadata")
    if metadata is None:
        metadata = {}
    if not isinstance(metadata, Mapping):
        raise fail(f"key 'metadata' must be an object, got {type(metadata).__name__}")
    metadata = dict(metadata)
    for key, value in row.items():  # columns the schema does not name travel as metadata
        if key not in used and key not in SCHEMA_KEYS and key not in metadata:
            metadata[key] = value
    rid = values.get("id")
    if rid is None or (isinstance(rid, str) and not rid.strip()):
        rid = auto_id
    elif isinstance(rid, bool) or not isinstance(rid, (str, int)):
        raise fail(f"key 'id' must be a string or an integer, got {type(rid).__name__}")
    try:
        check_record(verifier, answer, metadata)
    except ValueError as exc:
        raise fail(f"key 'answer'/'metadata' cannot be scored by verifier {verifier!r}: {exc}") from None
    return PromptRecord(str(rid), prompt, messages, answer, verifier, metadata)


def _mapped_values(row: Mapping, columns: Mapping[str, str], fail) -> tuple[dict[str, Any], set]:
    """The schema keys found in ``row`` (through ``data.columns``) and the top-level columns they used.

    A column that ``columns`` maps to another key is read only as that key: with ``{messages: prompt}``
    the source's ``prompt`` is the chat, not also the schema's ``prompt``.
    """
    values: dict[str, Any] = {}
    used: set = set()
    claimed = {src.split(".", 1)[0] for src in columns.values()}
    for key in SCHEMA_KEYS:
        if key not in columns and key in claimed:
            continue
        src = columns.get(key, key)
        found, value = column_value(row, src)
        if found:
            used.add(src.split(".", 1)[0])
            values[key] = value
        elif key in columns:
            raise fail(
                f"column {src!r} (mapped to {key!r} by data.columns) is missing; the record has keys {sorted(row)}"
            )
    return values, used


def _prompt_or_messages(values: dict, row: Mapping, fail) -> tuple[str | None, list | None]:
    prompt, messages = values.get("prompt"), values.get("messages")
    if isinstance(prompt, (list, tuple)) and messages is None:
        prompt, messages = None, list(prompt)
    if prompt is not None and messages is not None:
        raise fail("has both 'prompt' and 'messages'; give exactly one")
    if prompt is None and messages is None:
        raise fail(f"missing required key 'prompt' (or 'messages'); the record has keys {sorted(row)}")
    if prompt is not None and (not isinstance(prompt, str) or not prompt.strip()):
        raise fail(f"key 'prompt' must be a non-empty string, got {prompt!r:.80}")
    if messages is not None:
        problem = _messages_problem(messages)
        if problem:
            raise fail(f"key 'messages': {problem}")
        messages = [{"role": m["role"], "content": m["content"]} for m in messages]
    return prompt, messages


def _answer(values: dict, row: Mapping, fail) -> str:
    if "answer" not in values or values["answer"] is None:
        raise fail(f"missing required key 'answer'; the record has keys {sorted(row)}")
    answer = values["answer"]
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        raise fail(f"key 'answer' must be a string or a number, got {type(answer).__name__}")
    answer = str(answer)
    if not answer.strip():
        raise fail("key 'answer' is empty")
    return answer


def _verifier(values: dict, names: _VerifierNames, fail) -> str:
    verifier = values.get("verifier") or names.default
    if verifier is None:
        raise fail(
            "missing key 'verifier' and no default verifier is set (data.default_verifier); "
            f"known verifiers: {', '.join(known_verifiers())}"
        )
    if not isinstance(verifier, str):
        raise fail(f"key 'verifier' must be a string, got {type(verifier).__name__}")
    problem = names.check(verifier)
    if problem:
        raise fail(f"key 'verifier': {problem}")
    return verifier


def _checked_columns(columns: Mapping[str, str | None] | None) -> dict[str, str]:
    """``data.columns`` without its unmapped keys (None), each key a schema key and each value a field name."""
    columns = {key: value for key, value in (columns or {}).items() if value is not None}
    bad_keys = sorted(set(columns) - set(SCHEMA_KEYS))
    if bad_keys:
        raise DataError(f"data.columns: unknown schema keys {bad_keys}; allowed: {list(SCHEMA_KEYS)}")
    for key, value in columns.items():
        if not isinstance(value, str) or not value:
            raise DataError(f"data.columns.{key} must be a field name, got {value!r}")
    return columns


def load_records(
    path_or_id: str | os.PathLike,
    *,
    default_verifier: str | None = None,
    user_verifiers: Iterable[str] = (),
    columns: Mapping[str, str] | None = None,
    split: str | None = None,
) -> list[PromptRecord]:
    """Load and validate every record of a .jsonl/.json/.parquet file, a ``save_to_disk`` directory or a hub id.

    Args:
        path_or_id: a local file or directory, or a Hugging Face data set id (needs a network).
        default_verifier: verifier for records that name none.
        user_verifiers: ``package.module:function`` verifiers that records may name.
        columns: schema key -> source field (dotted paths allowed; None: not mapped), for data sets with
            other field names.
        split: split of a ``datasets`` source (default: "train", or the only split there is).

    Raises:
        DataError (a ValueError) naming the source, line/row and key of the first bad record.
    """
    source = os.fspath(path_or_id)
    columns = _checked_columns(columns)
    names = _VerifierNames(default_verifier, list(user_verifiers))
    if default_verifier is not None:
        problem = names.check(default_verifier)
        if problem:
            raise DataError(f"default verifier: {problem}")
    label = Path(source).name or source
    records: list[PromptRecord] = []
    first_seen: dict[str, str] = {}
    for where, row in rows_of(source, split):
        if not records and is_verl_row(row):
            columns = {**VERL_COLUMNS, **columns}
        auto_id = f"{label}:{where.split()[-1]}"
        record = _build_record(row, source=source, where=where, auto_id=auto_id, names=names, columns=columns)
        if record.id in first_seen:
            raise DataError(f"{source}, {where}: duplicate id {record.id!r} (first seen at {first_seen[record.id]})")
        first_seen[record.id] = where
        records.append(record)
    if not records:
        raise DataError(f"{source}: contains no records")
    return records
