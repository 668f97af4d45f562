"""The subcommands' work: prepare the model, build Trainer and DataModule, fit, validate, export."""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import warnings
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

import lightning
from lightning.pytorch.accelerators import CPUAccelerator
from transformers import AutoTokenizer

from stare_lightning import collector
from stare_lightning.allocator import hint_if_page_faulting
from stare_lightning.config.instantiate import instantiate_collection, safe_instantiate
from stare_lightning.console import minutes
from stare_lightning.data.datamodule import PromptDataModule
from stare_lightning.data.tasks import sft_examples
from stare_lightning.data.tasks.tool_traces import countdown_tool_examples
from stare_lightning.models.cold_start import cold_start_key, expected_seconds, supervised_fine_tune
from stare_lightning.models.registry import default_cache_dir, resolve_model
from stare_lightning.rollout.backends import declared_backend
from stare_lightning.run_config import RunConfig
from stare_lightning.tools import Tool, build_format, build_tool_from_config
from stare_lightning.trainer.checkpoint_trust import vet_checkpoint


def prepare_model(cfg: RunConfig, datamodule: PromptDataModule | None = None, tool: Tool | None = None) -> Path:
    """Resolve ``model.name_or_path`` to a local HF directory, running the tiny model's cold start once
    (on tool-using traces with ``model.cold_start.tool_traces``, calling ``tool``, by default the one ``tools``
    names)."""
    cache_dir = Path(cfg.model.cache_dir) if cfg.model.cache_dir else default_cache_dir()
    base = resolve_model(cfg.model.name_or_path, cache_dir)
    cold = cfg.model.cold_start
    if cold is None or cold.steps == 0:
        return base
    if datamodule is None:
        datamodule = PromptDataModule(cfg.data, tokenizer=None)
        datamodule.load_records()
    target = cold_start_dir(cfg, datamodule, cache_dir)
    with exclusive_lock(cache_dir / f".{target.name}.lock"):  # one warm-up per key, however many processes ask
        if (target / "config.json").is_file():
            return target
        return _warm_up(cfg, base, target, datamodule, tool)


def cold_start_dir(cfg: RunConfig, datamodule: PromptDataModule, cache_dir: Path) -> Path:
    """Where the warm-up of these settings is cached. The key holds what the warm-up reads and nothing else, so
    validation settings (``data.val_size``, ``data.val_files``) do not repeat it."""
    cold = cfg.model.cold_start
    settings = {"base": cfg.model.name_or_path, "cold_start": asdict(cold), "train": records_digest(datamodule)}
    if cold.tool_traces:
        settings["tools"] = {"name": cfg.tools.name, "format": cfg.tools.format}
    return cache_dir / f"{cfg.model.name_or_path}-sft-{cold_start_key(settings)}"


def records_digest(datamodule: PromptDataModule) -> str:
    """A digest of the training records, in order: what a warm-up learns from. Each record is its fields' values as
    they are: ``dataclasses.astuple`` would deep-copy every value first (about 0.5 s for the built-in task's records,
    at every start) for the same JSON text."""
    records = datamodule.train_records
    names = [field.name for field in dataclasses.fields(records[0])] if records else []
    rows = [[getattr(record, name) for name in names] for record in records]
    return hashlib.sha256(json.dumps(rows, sort_keys=True, default=str).encode()).hexdigest()


@contextlib.contextmanager
def exclusive_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` (created if missing) for the duration."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _warm_up(cfg: RunConfig, base: Path, target: Path, datamodule: PromptDataModule, tool: Tool | None) -> Path:
    cold = cfg.model.cold_start
    if cold.tool_traces:
        tool = tool or build_tool_from_config(cfg.tools)  # `sft` alone: the tool only names the calls
        call_format = build_format(cfg.tools.format, tool, AutoTokenizer.from_pretrained(base))
        examples = countdown_tool_examples(datamodule.train_records, tool, call_format, seed=cold.seed)
    else:
        examples = sft_examples(datamodule.train_records)
    expected = expected_seconds(examples, steps=cold.steps, batch_size=cold.batch_size)
    print(
        f"[cold start] a supervised warm-up of the {cfg.model.name_or_path} model on this run's {len(examples)} "
        f"training examples before RL ({cold.steps} steps, model.cold_start): about {minutes(expected)} on an idle "
        f"2-core CPU; cached in {target}, so later runs with the same records and settings skip it",
        flush=True,
    )
    return supervised_fine_tune(
        base, target, examples, steps=cold.steps, batch_size=cold.batch_size, lr=cold.lr, seed=cold.seed
    )


def build_trainer(cfg: RunConfig, **overrides) -> lightning.Trainer:
    callbacks = instantiate_collection(cfg.callbacks, extra_allowed=cfg.allowed_targets, where="callbacks")
    loggers = instantiate_collection(cfg.logger, extra_allowed=cfg.allowed_targets, where="logger")
    if cfg.summary:
        from stare_lightning.callbacks import RunSummary

        callbacks.append(RunSummary(name=cfg.algorithm.name))
    trainer_cfg = dict(cfg.trainer)
    trainer_cfg.update(overrides)
    # Plugins (the checkpoint IO) come from the trainer config: conf/trainer/*.yaml choose them per strategy.
    return safe_instantiate(
        trainer_cfg,
        callbacks=callbacks,
        logger=loggers or False,
        extra_allowed=cfg.allowed_targets,
        where="trainer",
        _convert_="all",
    )


def _setup(cfg: RunConfig):
    lightning.seed_everything(cfg.seed, workers=True, verbose=False)
    # Data first: a malformed file or an unknown verifier fails before any model is prepared or trained.
    datamodule = PromptDataModule(cfg.data, tokenizer=None)
    datamodule.load_records()
    tool = build_tool_from_config(cfg.tools)  # a missing or broken sandbox fails here, before the model
    backend = declared_backend(cfg.rollout.backend)
    if backend is not None:  # and so do running servers that do not answer or refuse the credential
        backend.check_before_model(cfg.rollout)
    model_dir = prepare_model(cfg, datamodule, tool)
    return build_module(cfg, model_dir, datamodule, tool), datamodule


def build_module(cfg: RunConfig, model_dir: Path, datamodule: PromptDataModule, tool: Tool | None):
    """The LightningModule for the model in ``model_dir``, validating on ``datamodule``'s benchmarks; the data
    module gets the model's tokenizer. The one place a command builds it (``fit``, ``validate``, ``evaluate``)."""
    from stare_lightning.module import STAREModule

    datamodule.set_tokenizer(AutoTokenizer.from_pretrained(model_dir))
    return STAREModule.from_config(cfg, str(model_dir), datamodule.val_benchmarks(), tool=tool)


def _checkpoint_path(cfg: RunConfig) -> str | None:
    """The checkpoint to resume from, read through once as data only (a hostile one fails here, before any
    model is prepared); Lightning then loads it with ``weights_only=True``."""
    path = cfg.ckpt_path
    if path == "last":
        last = Path(cfg.output_dir) / "checkpoints" / "last.ckpt"
        path = str(last) if last.exists() else None
    if path is not None:
        vet_checkpoint(path)
    return path


# Lightning warnings that do not apply here: checkpoints hold the post-update state on purpose (that is what a
# resume continues from), the policy is in eval mode at fit start because the run validates first, and
# validation metrics are already reduced across ranks (torchmetrics states) before they are logged.
_EXPECTED_WARNINGS = (
    "Using ModelCheckpoint with manual optimization",
    "Found .* module\\(s\\) in eval mode",
    "It is recommended to use `self.log\\('val/",
)


def ignore_expected_warnings() -> None:
    for message in _EXPECTED_WARNINGS:
        warnings.filterwarnings("ignore", message=message)


def fit(cfg: RunConfig):
    ignore_expected_warnings()
    ckpt_path = _checkpoint_path(cfg)
    module, datamodule = _setup(cfg)
    trainer = build_trainer(cfg)
    hint_if_page_faulting(isinstance(trainer.accelerator, CPUAccelerator))
    collector.freeze_setup()
    if cfg.validation.before_fit and ckpt_path is None:
        trainer.validate(module, datamodule=datamodule, verbose=False)
    trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path, weights_only=True)
    return trainer


def validate(cfg: RunConfig):
    ignore_expected_warnings()
    ckpt_path = _checkpoint_path(cfg)
    module, datamodule = _setup(cfg)
    trainer = build_trainer(cfg)
    collector.freeze_setup()
    return trainer.validate(module, datamodule=datamodule, ckpt_path=ckpt_path, weights_only=True)


def export(cfg: RunConfig) -> Path:
    """Write an HF directory (weights, config, tokenizer) from a checkpoint of ``fit``."""
    if not cfg.ckpt_path or not cfg.export_dir:
        raise ValueError("export needs ckpt_path=<checkpoint file or directory> and export_dir=<directory>")
    from stare_lightning.models.export import export_checkpoint

    return export_checkpoint(cfg.ckpt_path, cfg.export_dir)
