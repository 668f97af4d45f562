"""``DataConfig``: the typed ``data`` config group, checked in ``__post_init__`` before anything runs.

Plain types only (str / int / bool / Optional / list / dict), so it works as an OmegaConf structured
config. Two ways to get prompts:

- a built-in task (``task: countdown | arithmetic``, settings in ``task_kwargs``): ``train_size`` and
  ``val_size`` records are generated, deterministically from ``seed``;
- a reasoning-gym generator (``source: reasoning_gym``, ``task: <generator> | mixture``, the generator's
  settings in ``task_kwargs``; ``tasks/reasoning_gym.py``), generated the same way;
- files (``task: null``, ``train_files`` and optionally ``val_files``): every record of every file is
  used (``train_size`` does not apply); without ``val_files``, ``val_size`` records are held out from
  the training files (a seeded draw), and ``val_size: 0`` turns validation off.

``val_files``, when given, are the validation data in both cases (with a task, instead of its generated
validation split); each file is a benchmark (``benchmarks``), sampled as ``val_sets`` says.

``prompts_per_step`` prompts go to each rank per step, so one optimizer step sees
``global_batch_size(world_size)`` prompts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from ..config.checks import choice, note, number, text
from ..rewards.registry import get_verifier, is_user_verifier_name
from .records import SCHEMA_KEYS
from .tasks import SOURCES, STYLES, reasoning_gym, task_names, task_params


@dataclass
class ValSetConfig:
    """Sampling of the benchmark ``name``; a null key takes the rollout group's validation setting."""

    name: str = ""
    """The benchmark: a record's `metadata.data_source`, else its validation file's stem."""
    n: int | None = None
    """Samples per problem (avg@n, pass@k, maj@n); null: `rollout.val_n`."""
    temperature: float | None = None
    """Sampling temperature; null: `rollout.val_temperature`."""
    top_p: float | None = None
    """Nucleus sampling threshold; null: `rollout.val_top_p`."""
    max_new_tokens: int | None = None
    """Longest response; null: `rollout.max_new_tokens`."""

    def check(self, key: str) -> None:
        text(f"{key}.name", self.name)
        if self.n is not None:
            number(f"{key}.n", self.n, low=1, integer=True)
        if self.temperature is not None:
            number(f"{key}.temperature", self.temperature, low=0.0, low_open=True)
        if self.top_p is not None:
            number(f"{key}.top_p", self.top_p, low=0.0, high=1.0, low_open=True)
        if self.max_new_tokens is not None:
            number(f"{key}.max_new_tokens", self.max_new_tokens, low=1, integer=True)


@dataclass
class DataConfig:
    """Where prompts come from and how they are batched. See the module docstring."""

    task: str | None = "countdown"
    """A built-in task, a reasoning-gym generator or `mixture` (see `source`); null: train from files."""
    source: str = "builtin"
    """What `task` names: a built-in task or a reasoning-gym generator (`data=reasoning_gym` sets it)."""
    task_kwargs: dict = field(default_factory=dict)
    """The task's or generator's own settings, checked against its parameters."""
    prompt_style: str = "plain"
    """`instruct` wraps plain prompts in the tokenizer's chat template; message records always are."""
    train_files: list[str] = field(default_factory=list)
    """JSONL / JSON / Parquet files or `datasets` directories of prompt records (with `task: null`)."""
    val_files: list[str] = field(default_factory=list)
    """Validation files, each a benchmark; replace a task's generated validation split."""
    train_size: int = 20000
    """Records a task generates for training."""
    val_size: int = 64
    """Validation records a task generates, or holds out of the training files (0: no validation)."""
    seed: int = 1234
    """Seed of the generated records, the held-out split and the epoch permutations."""
    prompts_per_step: int = 16
    """Prompts each rank takes per step (`rollout.n` samples each)."""
    val_batch_size: int = 64
    """Prompts per validation batch."""
    max_prompt_length: int = 64
    """Prompt tokens kept; longer prompts are cut from the left, with a warning."""
    num_workers: int = 0
    """DataLoader worker processes (0: in the main process)."""
    default_verifier: str | None = None
    """Verifier of file records that name none (tasks set their own)."""
    user_verifiers: list[str] = field(default_factory=list)
    """`package.module:function` verifiers that records may name."""
    # Schema key -> field name in the files (dotted paths allowed). Every schema key is present (None: not
    # mapped), so that `data.columns={answer: reward_model.ground_truth}` works without Hydra's `+`.
    columns: dict = field(default_factory=lambda: dict.fromkeys(SCHEMA_KEYS))
    """Schema key -> field name in the files (dotted paths reach into nested fields)."""
    train_split: str = "train"
    """Split of a `datasets` directory that holds the training records."""
    val_split: str = "test"
    """Split of a `datasets` directory that holds the validation records."""
    val_sets: list[ValSetConfig] = field(default_factory=list)
    """Per-benchmark validation sampling, by benchmark name (`{name, n, temperature, top_p, max_new_tokens}`)."""

    def __post_init__(self) -> None:
        # OmegaConf hands over ListConfig / DictConfig; keep plain containers from here on.
        for name in ("train_files", "val_files", "user_verifiers"):
            value = getattr(self, name)
            if isinstance(value, str) or not isinstance(value, Sequence):
                raise ValueError(f"data.{name}={value!r} is not allowed: must be a list of strings")
            value = list(value)
            for i, item in enumerate(value):
                text(f"data.{name}[{i}]", item)
            setattr(self, name, value)
        for name in ("task_kwargs", "columns"):
            value = getattr(self, name)
            if not isinstance(value, Mapping):
                raise ValueError(f"data.{name}={value!r} is not allowed: must be a mapping")
            setattr(self, name, dict(value))

        minimum = {
            "train_size": 1,
            "val_size": 0,
            "seed": 0,
            "prompts_per_step": 1,
            "val_batch_size": 1,
            "max_prompt_length": 1,
            "num_workers": 0,
        }
        for name, low in minimum.items():
            number(f"data.{name}", getattr(self, name), low=low, integer=True)

        choice("data.prompt_style", self.prompt_style, STYLES)
        self._check_source()
        self._check_verifiers()

        bad = sorted(set(self.columns) - set(SCHEMA_KEYS))
        if bad:
            raise ValueError(f"data.columns: unknown schema keys {bad}; allowed: {list(SCHEMA_KEYS)}")
        for key, value in self.columns.items():
            if value is not None:
                text(f"data.columns.{key}", value)
        for name in ("train_split", "val_split"):
            text(f"data.{name}", getattr(self, name))
        self.val_sets = [ValSetConfig(**dict(v)) if isinstance(v, Mapping) else v for v in self.val_sets]
        for index, val_set in enumerate(self.val_sets):
            val_set.check(f"data.val_sets[{index}]")
        names = [v.name for v in self.val_sets]
        if len(set(names)) != len(names):
            raise ValueError(f"data.val_sets names a benchmark twice: {names}")

    def _check_source(self) -> None:
        """Exactly one source: a built-in or reasoning-gym task (with valid keyword arguments) or training files."""
        choice("data.source", self.source, SOURCES)
        note("data.task", _task_rule)
        gym = self.source == "reasoning_gym"
        if gym and self.task is None:
            raise ValueError("data.source=reasoning_gym needs data.task: a reasoning-gym generator name or 'mixture'")
        if self.task is not None:
            if not gym:
                try:
                    choice("data.task", self.task, (*task_names(), None))
                except ValueError as exc:
                    raise ValueError(f"{exc}; for a reasoning-gym generator use data=reasoning_gym") from None
            if self.train_files:
                raise ValueError(
                    f"data.task={self.task!r} and data.train_files are both set; "
                    "set data.task=null to train from files, or drop the files to use the built-in task"
                )
            if gym:  # raises on unknown generators, unknown keys and settings the generator refuses
                self.task_kwargs = reasoning_gym.jsonable(self.task_kwargs)
                reasoning_gym.parse_source(self.task, self.task_kwargs)
            else:
                task_params(self.task, self.task_kwargs)  # raises on unknown / bad keys
        else:
            if not self.train_files:
                raise ValueError("data.task is null, so data.train_files must list at least one file or data set")
            if self.task_kwargs:
                raise ValueError("data.task_kwargs is set but data.task is null; remove it or choose a task")

    def _check_verifiers(self) -> None:
        """User verifiers and the default verifier must name functions that exist."""
        for name in self.user_verifiers:
            if not is_user_verifier_name(name):
                raise ValueError(f"data.user_verifiers: {name!r} is not of the form 'package.module:function'")
            try:
                get_verifier(name)
            except ValueError as exc:
                raise ValueError(f"data.user_verifiers: {exc}") from None
        if self.default_verifier is not None:
            try:
                get_verifier(self.default_verifier)
            except ValueError as exc:
                raise ValueError(f"data.default_verifier: {exc}") from None

    def global_batch_size(self, world_size: int) -> int:
        """Prompts per optimizer step over all ranks."""
        return self.prompts_per_step * world_size

    def allowed_user_verifiers(self) -> list[str]:
        """User verifier names records may use: ``user_verifiers`` plus a user ``default_verifier``."""
        names = list(self.user_verifiers)
        default = self.default_verifier
        if default and is_user_verifier_name(default) and default not in names:
            names.append(default)
        return names


def _task_rule() -> str:
    """What ``data.task`` accepts, by ``data.source``: the configuration reference's allowed values."""
    builtin = ", ".join(repr(name) for name in task_names())
    try:
        generators = f"one of [{', '.join(repr(name) for name in reasoning_gym.generator_names())}]"
    except ImportError:  # the reasoning_gym extra is not installed: its generators cannot be listed
        generators = "a reasoning-gym generator's name (install the reasoning_gym extra)"
    return (
        f"with data.source=builtin: one of [{builtin}], or null to train from data.train_files; "
        f"with data.source=reasoning_gym: 'mixture' or {generators}"
    )
