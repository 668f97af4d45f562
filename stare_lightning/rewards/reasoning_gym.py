"""The ``reasoning_gym`` verifier: a response scored by its reasoning-gym generator's own ``score_answer``.

A record built by ``data=reasoning_gym`` (``stare_lightning.data.tasks.reasoning_gym``) carries everything
needed to rebuild its entry in ``metadata["reasoning_gym"]``: the generator name, the generator settings
it was built with (``config``, JSON), the generator's ``seed``, the entry's oracle ``answer`` (a string,
or null for generators without a single oracle answer) and the entry's ``metadata`` (converted to JSON).
The verifier rebuilds the generator (cached per name / settings / seed: several scorers read
``self.config``) and calls ``score_answer(text, {"question": "", "answer": ..., "metadata": ...})``. The
question is not stored: no scorer of reasoning-gym 0.1.25 reads it.

``text`` is read from the response the way the project's other verifiers read it (``extract.final_answer``):
the content of the last ``\\boxed{}``, else what follows the last ``Answer:`` line, else the whole response;
surrounding whitespace is stripped and nothing else (no ``$...$`` or trailing-period stripping: some
reasoning-gym answers are sentences that end in a full stop). reasoning-gym's own ``<answer>`` tags are
not read. Scores are the generator's, partial credit included (many generators give
``len(oracle) / len(text)`` when the oracle is a substring of the text).
"""

from __future__ import annotations

import copy
import json
from collections import OrderedDict
from typing import Any

from .extract import final_answer

METADATA_KEY = "reasoning_gym"
_CACHE_SIZE = 64
_generators: OrderedDict = OrderedDict()


def import_reasoning_gym():
    """The ``reasoning_gym`` package (about two seconds to import the first time)."""
    import reasoning_gym

    return reasoning_gym


def generator(name: str, config: dict, seed: int):
    """The generator ``name`` built with ``config`` and ``seed`` (the last ``_CACHE_SIZE`` are kept)."""
    key = (name, json.dumps(config, sort_keys=True), seed)
    dataset = _generators.get(key)
    if dataset is None:
        dataset = import_reasoning_gym().create_dataset(name, seed=seed, **copy.deepcopy(config))
        _generators[key] = dataset
        if len(_generators) > _CACHE_SIZE:
            _generators.popitem(last=False)
    else:
        _generators.move_to_end(key)
    return dataset


def response_answer(response: str) -> str:
    """What is handed to ``score_answer``: the last boxed answer, else the ``Answer:`` line, else everything."""
    found = final_answer(response)
    return (response if found is None else found).strip()


def score_entry(info: dict, text: str | None) -> float:
    """``score_answer(text, entry)`` of the generator ``info`` describes, on the entry rebuilt from ``info``."""
    dataset = generator(info["generator"], info["config"], info["seed"])
    entry = {"question": "", "answer": info["answer"], "metadata": copy.deepcopy(info["metadata"])}
    return float(dataset.score_answer(text, entry))


def verify_reasoning_gym(response: str, answer: str, metadata: dict) -> float:
    """The generator's own score of the response's final answer (see the module docstring)."""
    return score_entry(metadata[METADATA_KEY], response_answer(response))


def check_reasoning_gym_record(answer: str, metadata: dict) -> None:
    """Raise ValueError when ``metadata`` cannot describe a reasoning-gym entry."""
    info: Any = metadata.get(METADATA_KEY)
    if not isinstance(info, dict):
        raise ValueError(
            f"reasoning_gym records need metadata key {METADATA_KEY!r}: an object with generator, config, seed, "
            "answer and metadata (records built by data=reasoning_gym have it)"
        )
    problems = []
    if not isinstance(info.get("generator"), str) or not info.get("generator"):
        problems.append("'generator' must be a generator name")
    if not isinstance(info.get("config"), dict):
        problems.append("'config' must be an object of generator settings")
    if type(info.get("seed")) is not int:
        problems.append("'seed' must be an integer")
    if info.get("answer") is not None and not isinstance(info.get("answer"), str):
        problems.append("'answer' must be a string or null")
    if not isinstance(info.get("metadata"), dict):
        problems.append("'metadata' must be an object")
    if problems:
        raise ValueError(f"metadata {METADATA_KEY!r}: " + "; ".join(problems))


def prepare_reasoning_gym(response: str, answer: str, metadata: dict) -> None:
    """Build (and cache) the record's generator before the guarded call: building one creates classes from
    generated source (namedtuples, dataclasses), which the scoring guard would refuse. Runs in the confined worker."""
    info = metadata[METADATA_KEY]
    generator(info["generator"], info["config"], info["seed"])


verify_reasoning_gym.check_record = check_reasoning_gym_record
verify_reasoning_gym.prepare = prepare_reasoning_gym
verify_reasoning_gym.warmup = import_reasoning_gym
