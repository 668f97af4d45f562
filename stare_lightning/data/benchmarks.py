"""Validation benchmarks: every validation record belongs to one, each with its own sampling settings.

A record's benchmark is its ``metadata["data_source"]`` (verl-style data and this project's recipes set
it); otherwise the stem of the validation file it came from, the built-in task's name, or ``heldout`` for
records held out of the training files. ``data.val_sets`` (a list of ``{name, n, temperature, top_p,
max_new_tokens}``) overrides the rollout group's validation sampling (``val_n``, ``val_temperature``,
``val_top_p``, ``max_new_tokens``) for the benchmark it names.
Validation batches never mix benchmarks, so each batch is sampled with one setting.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import replace

from torch.utils.data import IterableDataset, get_worker_info

from ..rollout.base import SamplingParams
from ..rollout.config import RolloutConfig
from .config import ValSetConfig
from .records import PromptRecord

SOURCE_KEY = "data_source"


def benchmark_of(record: PromptRecord) -> str:
    return str(record.metadata[SOURCE_KEY])


def with_benchmark(records: Sequence[PromptRecord], default: str) -> list[PromptRecord]:
    """``records`` with ``metadata["data_source"]`` set to ``default`` where they name none."""
    return [
        r if r.metadata.get(SOURCE_KEY) else replace(r, metadata={**r.metadata, SOURCE_KEY: default}) for r in records
    ]


def benchmark_names(records: Sequence[PromptRecord]) -> list[str]:
    """The benchmarks of ``records`` in order of first appearance."""
    return list(dict.fromkeys(benchmark_of(r) for r in records))


def check_val_sets(val_sets: Sequence[ValSetConfig], names: Sequence[str]) -> None:
    """Every ``data.val_sets`` entry must name a benchmark of the validation data."""
    unknown = sorted({v.name for v in val_sets} - set(names))
    if unknown:
        raise ValueError(
            f"data.val_sets names benchmarks {unknown} that no validation record belongs to; "
            f"the validation benchmarks are {list(names)}"
        )


def benchmark_sampling(
    rollout: RolloutConfig, val_sets: Sequence[ValSetConfig], names: Sequence[str]
) -> dict[str, SamplingParams]:
    """Each benchmark's validation sampling: the rollout group's, with the benchmark's ``val_sets`` entry on top."""
    own = {v.name: v for v in val_sets}
    sampling = {}
    for name in names:
        entry = own.get(name, ValSetConfig(name=name))
        keys = ("n", "temperature", "top_p", "max_new_tokens")
        sampling[name] = rollout.validation_sampling(**{k: getattr(entry, k) for k in keys})
    return sampling


class ValPromptBatches(IterableDataset):
    """The finite validation batches of one rank, benchmark by benchmark.

    Within a benchmark of N records rank ``r`` takes records ``r, r + W, ...``; every rank gets
    ceil(ceil(N / W) / batch_size) batches of it (so collective calls inside ``validation_step`` line up),
    with its records spread evenly over them: ranks may hold one record more or less than each other and
    batches may be smaller than ``batch_size`` (even empty, with ``batch_size=1`` and N not divisible by W).
    """

    def __init__(
        self,
        records: list[PromptRecord],
        encode: Callable[[PromptRecord], dict],
        *,
        batch_size: int,
        rank: int,
        world_size: int,
    ) -> None:
        self.encode = encode
        self.batches: list[list[PromptRecord]] = []
        for name in benchmark_names(records):
            members = [r for r in records if benchmark_of(r) == name]
            shard = members[rank::world_size]
            num_batches = math.ceil(math.ceil(len(members) / world_size) / batch_size)
            start = 0
            for b in range(num_batches):
                size = len(shard) // num_batches + (1 if b < len(shard) % num_batches else 0)
                self.batches.append(shard[start : start + size])
                start += size

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self):
        info = get_worker_info()
        worker, num_workers = (info.id, info.num_workers) if info is not None else (0, 1)
        for b, batch in enumerate(self.batches):
            if b % num_workers == worker:
                yield [self.encode(r) for r in batch]
