"""``PromptDataModule``: streams tokenised prompt records, sharded over ranks, resumable mid-stream.

No generation happens here (rollouts run inside ``training_step``); each loader batch is a plain list of
item dicts::

    {"id": str, "prompt_ids": list[int], "prompt_text": str, "answer": str, "verifier": str, "metadata": dict}

``prompt_text`` is the rendered prompt (after the chat template, before truncation); ``prompt_ids`` keeps
its last ``max_prompt_length`` tokens (left truncation: the end of a prompt, where the question and the
generation prompt sit, survives; a leading BOS token goes with the rest); rendering and encoding live in
``prompts``.

Training loader: infinite. Epoch ``e`` visits the training records in a permutation seeded by
``seed + e``, cut into global batches of ``prompts_per_step * world_size`` (the tail that does not fill a
global batch is skipped in that epoch); rank ``r`` takes slice ``r`` of every global batch, so ranks never
share a prompt within a step. The position is the number of batches consumed, counted in
``on_after_batch_transfer`` while the trainer is training (Lightning fetches one batch ahead, so counting
in the iterator would be one off); it is saved by ``state_dict`` and restored by ``load_state_dict``, so a
resumed run continues with exactly the batches an uninterrupted run would have seen. The
LightningModule must not override ``on_after_batch_transfer`` (Lightning would then call only the
datamodule's and warn).

Validation loader: finite, the whole validation split, no duplicates and no padding, benchmark by
benchmark (``benchmarks``: a batch never mixes benchmarks, every rank gets the same number of batches).
"""

from __future__ import annotations

import random
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import lightning as L
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from .benchmarks import ValPromptBatches, benchmark_names, check_val_sets, with_benchmark
from .config import DataConfig
from .prompts import PromptEncoder, has_chat_template, render_prompt
from .records import PromptRecord, load_records
from .tasks import build_records


def epoch_order(num_records: int, seed: int, epoch: int) -> list[int]:
    """The visiting order of epoch ``epoch``: a permutation seeded by ``seed + epoch``."""
    order = list(range(num_records))
    random.Random(seed + epoch).shuffle(order)
    return order


class TrainPromptStream(IterableDataset):
    """Infinite stream of per-rank prompt batches (lists of item dicts), starting at ``start_batch``."""

    def __init__(
        self,
        records: list[PromptRecord],
        encode: Callable[[PromptRecord], dict],
        *,
        seed: int,
        prompts_per_step: int,
        rank: int,
        world_size: int,
        start_batch: int = 0,
    ) -> None:
        self.records = records
        self.encode = encode
        self.seed = seed
        self.per_rank = prompts_per_step
        self.rank = rank
        self.world_size = world_size
        self.global_batch = prompts_per_step * world_size
        self.batches_per_epoch = len(records) // self.global_batch
        if self.batches_per_epoch < 1:
            raise ValueError(
                f"{len(records)} training records cannot fill one global batch of {self.global_batch} "
                f"(data.prompts_per_step={prompts_per_step} x world size {world_size})"
            )
        self.start_batch = start_batch
        self._order: tuple[int, list[int]] | None = None  # the last epoch's visiting order

    def __iter__(self):
        info = get_worker_info()
        worker, num_workers = (info.id, info.num_workers) if info is not None else (0, 1)
        batch = self.start_batch
        while True:
            if batch % num_workers == worker:  # DataLoader workers are read round-robin: order is kept
                yield self.batch(batch)
            batch += 1

    def batch(self, index: int) -> list[dict]:
        """This rank's prompts of global batch ``index`` (what the stream yields there)."""
        epoch, j = divmod(index, self.batches_per_epoch)
        order = self._order  # one read: the trainer's loader and the asynchronous producer both call this
        if order is None or order[0] != epoch:
            order = self._order = (epoch, epoch_order(len(self.records), self.seed, epoch))
        lo = j * self.global_batch + self.rank * self.per_rank
        return [self.encode(self.records[i]) for i in order[1][lo : lo + self.per_rank]]


def _as_is(batch: Any) -> Any:
    return batch


class PromptDataModule(L.LightningDataModule):
    """Prompt records for RL: an infinite, resumable training stream and a finite validation split.

    Args:
        cfg: the data config (a ``DataConfig`` or a mapping of its fields).
        tokenizer: a ``transformers`` tokenizer.
        rank: overrides the trainer's rank (for tests and tools that run without a Trainer; with ``world_size``).
        world_size: overrides the trainer's world size (with ``rank``).
    """

    def __init__(
        self, cfg: DataConfig, tokenizer: Any, *, rank: int | None = None, world_size: int | None = None
    ) -> None:
        super().__init__()
        if isinstance(cfg, Mapping):
            cfg = DataConfig(**cfg)
        if not isinstance(cfg, DataConfig):
            raise TypeError(f"PromptDataModule needs a DataConfig, got {type(cfg).__name__}")
        if (rank is None) != (world_size is None):
            raise ValueError("give both rank and world_size, or neither")
        if world_size is not None and not (type(world_size) is int and type(rank) is int and 0 <= rank < world_size):
            raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
        self.cfg = cfg
        self.tokenizer = tokenizer
        self._rank_override, self._world_override = rank, world_size
        self.train_records: list[PromptRecord] | None = None
        self.val_records: list[PromptRecord] | None = None
        self.batches_consumed = 0
        self._train_stream: TrainPromptStream | None = None
        self._encoder = PromptEncoder(tokenizer, cfg.prompt_style, cfg.max_prompt_length)

    # -- topology --------------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        if self._rank_override is not None:
            return self._rank_override
        return self.trainer.global_rank if self.trainer is not None else 0

    @property
    def world_size(self) -> int:
        if self._world_override is not None:
            return self._world_override
        return self.trainer.world_size if self.trainer is not None else 1

    @property
    def global_batch_size(self) -> int:
        return self.cfg.global_batch_size(self.world_size)

    # -- loading ---------------------------------------------------------------------------------
    def load_records(self) -> None:
        """Read and validate every record (files, verifiers) without a tokenizer: cheap, and done first so
        bad input fails before any model is prepared."""
        if self.train_records is None:
            self.train_records, self.val_records = self._load()
            check_val_sets(self.cfg.val_sets, self.val_benchmarks())

    def val_benchmarks(self) -> list[str]:
        """The validation benchmarks, in order of first appearance in the validation records."""
        return benchmark_names(self.val_records or [])

    def set_tokenizer(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._encoder = PromptEncoder(tokenizer, self.cfg.prompt_style, self.cfg.max_prompt_length)

    def setup(self, stage: str | None = None) -> None:
        if self.train_records is None or not getattr(self, "_records_checked", False):
            self.load_records()
            self._check_records()
            self._records_checked = True
        if len(self.train_records) < self.global_batch_size:
            raise ValueError(
                f"{len(self.train_records)} training records cannot fill one global batch of {self.global_batch_size} "
                f"(data.prompts_per_step={self.cfg.prompts_per_step} x world size {self.world_size})"
            )

    def _load(self) -> tuple[list[PromptRecord], list[PromptRecord]]:
        """Training and validation records; every validation record names its benchmark (``benchmarks``)."""
        cfg = self.cfg
        kwargs = dict(
            default_verifier=cfg.default_verifier,
            user_verifiers=cfg.allowed_user_verifiers(),
            columns=cfg.columns,
        )
        if cfg.task is not None:
            common = dict(
                style=cfg.prompt_style, seed=cfg.seed, val_size=cfg.val_size, source=cfg.source, **cfg.task_kwargs
            )
            train = build_records(cfg.task, "train", cfg.train_size, **common)
            if cfg.val_files:
                return train, self._val_files(kwargs)
            return train, with_benchmark(build_records(cfg.task, "val", 0, **common), cfg.task)
        train = self._merge(
            [load_records(p, split=cfg.train_split, **kwargs) for p in cfg.train_files], cfg.train_files
        )
        if cfg.val_files:
            return train, self._val_files(kwargs)
        if cfg.val_size == 0:
            return train, []
        if cfg.val_size >= len(train):
            raise ValueError(
                f"data.val_size={cfg.val_size} would hold out all {len(train)} training records; "
                "lower it, give data.val_files, or set data.val_size=0"
            )
        held = set(random.Random(f"holdout/{cfg.seed}").sample(range(len(train)), cfg.val_size))
        val = with_benchmark([r for i, r in enumerate(train) if i in held], "heldout")
        return [r for i, r in enumerate(train) if i not in held], val

    def _val_files(self, kwargs: dict) -> list[PromptRecord]:
        """The records of ``data.val_files``, each file a benchmark named by its stem unless records name theirs."""
        files = self.cfg.val_files
        parts = [with_benchmark(load_records(p, split=self.cfg.val_split, **kwargs), Path(p).stem) for p in files]
        return self._merge(parts, files)

    @staticmethod
    def _merge(parts: list[list[PromptRecord]], sources: list[str]) -> list[PromptRecord]:
        seen: dict[str, str] = {}
        merged: list[PromptRecord] = []
        for records, source in zip(parts, sources):
            for r in records:
                if r.id in seen and seen[r.id] != source:
                    raise ValueError(
                        f"record id {r.id!r} appears in both {seen[r.id]} and {source}; ids must be unique"
                    )
                seen[r.id] = source
                merged.append(r)
        return merged

    def _check_records(self) -> None:
        """Fail before training when a record cannot be rendered with this tokenizer."""
        if not has_chat_template(self.tokenizer):
            for r in (*self.train_records, *self.val_records):
                if r.messages is not None:
                    render_prompt(r, self.tokenizer, self.cfg.prompt_style)  # raises with the record id
        if self.train_records:
            self._encoder(self.train_records[0])  # the tokenizer works on this kind of prompt

    # -- loaders ---------------------------------------------------------------------------------
    def train_dataloader(self) -> DataLoader:
        self._require_setup()
        self._train_stream = TrainPromptStream(
            self.train_records,
            self._encoder,
            seed=self.cfg.seed,
            prompts_per_step=self.cfg.prompts_per_step,
            rank=self.rank,
            world_size=self.world_size,
            start_batch=self.batches_consumed,
        )
        return DataLoader(
            self._train_stream,
            batch_size=None,
            collate_fn=_as_is,
            num_workers=self.cfg.num_workers,
            persistent_workers=self.cfg.num_workers > 0,
        )

    def val_dataloader(self):
        self._require_setup()
        if not self.val_records:
            return []
        batches = ValPromptBatches(
            self.val_records,
            self._encoder,
            batch_size=self.cfg.val_batch_size,
            rank=self.rank,
            world_size=self.world_size,
        )
        return DataLoader(batches, batch_size=None, collate_fn=_as_is, num_workers=self.cfg.num_workers)

    def _require_setup(self) -> None:
        if self.train_records is None:
            raise RuntimeError("PromptDataModule.setup() must run before asking for a dataloader")

    def train_batch(self, index: int) -> list[dict]:
        """This rank's prompts of training batch ``index``, as the training dataloader yields them there (the
        asynchronous producer reads batches ahead of the trainer through this)."""
        self._require_setup()
        if self._train_stream is None:
            raise RuntimeError("PromptDataModule.train_dataloader() must run before train_batch()")
        return self._train_stream.batch(index)

    def more_prompts(self, count: int, *, step: int, attempt: int) -> list[dict]:
        """Extra prompts for dynamic sampling's further generation batches: ``count`` per rank.

        One draw without replacement of ``count x world size`` records per (data seed, step, attempt), of
        which rank ``r`` takes slice ``r``: ranks never share a prompt within an attempt (rollouts are seeded
        per prompt, so a shared one would give two ranks the same samples). Drawn from a seed rather than a
        stream position, so they need no state of their own and a resumed run draws exactly the same ones.
        With fewer records than ``count x world size`` every rank gets a smaller share.
        """
        self._require_setup()
        rng = random.Random(f"more/{self.cfg.seed}/{step}/{attempt}")
        total = len(self.train_records)
        picks = rng.sample(range(total), min(count * self.world_size, total))
        share = len(picks) // self.world_size
        mine = picks[self.rank * share : (self.rank + 1) * share]
        return [self._encoder(self.train_records[i]) for i in mine]

    # -- position --------------------------------------------------------------------------------
    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        trainer = self.trainer
        if trainer is not None and trainer.training:
            self.batches_consumed += 1
        return batch

    def state_dict(self) -> dict[str, Any]:
        return {
            "batches_consumed": self.batches_consumed,
            "global_batch_size": self.global_batch_size,
            "num_train_records": len(self.train_records) if self.train_records is not None else None,
            "seed": self.cfg.seed,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        consumed = state_dict.get("batches_consumed")
        if type(consumed) is not int or consumed < 0:
            raise ValueError(f"PromptDataModule state: 'batches_consumed' must be a non-negative int, got {consumed!r}")
        old_global = state_dict.get("global_batch_size")
        if old_global and old_global != self.global_batch_size:
            new = consumed * old_global // self.global_batch_size
            warnings.warn(
                f"resuming with a global batch of {self.global_batch_size} prompts instead of {old_global}: "
                f"continuing at batch {new} (~{consumed * old_global} prompts seen); "
                "the order will not match the first run",
                stacklevel=2,
            )
            consumed = new
        now_records = len(self.train_records) if self.train_records is not None else None
        for key, now in (("num_train_records", now_records), ("seed", self.cfg.seed)):
            before = state_dict.get(key)
            if before is not None and now is not None and before != now:
                warnings.warn(
                    f"resuming with data {key}={now} instead of {before}: the prompt order differs from the first run",
                    stacklevel=2,
                )
        self.batches_consumed = consumed
        if self._train_stream is not None:
            self._train_stream.start_batch = consumed
