"""The subcommands: one table that the usage text and the dispatch both read, and what each does with a config.

Most subcommands take a Hydra config; those named in ``PLAIN_SUBCOMMANDS`` (``prepare``) take their own
command-line arguments instead and never start Hydra. Light to import (``__main__`` reads the table before
anything heavy loads): the schema, Hydra and the training code are imported inside the functions that need
them. Tests call these functions directly; ``compose`` builds the config the command line would, without a
Hydra run.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from stare_lightning.run_config import RunConfig

# name -> ("module:function", one line of help). The function gets the validated RunConfig, or, for the
# names in PLAIN_SUBCOMMANDS, the argument list after the subcommand (and returns the exit status).
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "fit": ("stare_lightning.train:fit", "train (default: STARE-O1, built-in tiny model, countdown, offline)"),
    "validate": ("stare_lightning.train:validate", "evaluate a checkpoint: ckpt_path=... (or the starting policy)"),
    "evaluate": (
        "stare_lightning.evaluation.run:evaluate",
        "per-benchmark avg@n / pass@k / maj@n of a model: data.val_files=[...] output_dir=... (ckpt_path=...)",
    ),
    "sft": ("stare_lightning.train:prepare_model", "prepare the built-in tiny model's supervised cold start (cached)"),
    "export": (
        "stare_lightning.train:export",
        "write a Hugging Face directory from a checkpoint: ckpt_path=... export_dir=...",
    ),
    "serve": (
        "stare_lightning.serve:serve",
        "start rollout servers for runs elsewhere (rollout=server rollout.server.host=... port=...); Ctrl-C stops",
    ),
    "prepare": (
        "stare_lightning.data.recipes:main",
        "turn a public data set release into prompt records: NAME --src PATH --out PATH (--list, --help)",
    ),
}
PLAIN_SUBCOMMANDS: frozenset[str] = frozenset({"prepare"})  # argparse-style: no Hydra config


def usage() -> str:
    width = max(len(name) for name in SUBCOMMANDS)
    hydra = [name for name in SUBCOMMANDS if name not in PLAIN_SUBCOMMANDS]
    plain = [name for name in SUBCOMMANDS if name in PLAIN_SUBCOMMANDS]
    lines = ["usage: python -m stare_lightning {" + ",".join(hydra) + "} [key=value ...] [-m for sweeps]"]
    if plain:
        lines.append("       python -m stare_lightning {" + ",".join(plain) + "} [arguments ...] (see --help)")
    lines += [f"  {name:<{width}}  {help_line}" for name, (_, help_line) in SUBCOMMANDS.items()]
    lines.append(
        "python -m stare_lightning fit --help: the config groups and their options, and the keys changed most, with "
        "their meanings and allowed values"
    )
    return "\n".join(lines)


def config_dir() -> str:
    """``conf/`` beside the package (editable install) or inside it (wheel)."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "conf", here.parent / "conf"):
        if (candidate / "config.yaml").is_file():
            return str(candidate)
    raise FileNotFoundError(f"no conf/config.yaml next to {here}")


def register_schema() -> None:
    """Make ``RunConfig`` known to Hydra: ``conf/config.yaml`` names it as its first default."""
    from stare_lightning.run_config import register_schema as register

    register()


def compose(overrides: Sequence[str] = (), *, with_hydra: bool = False, config_name: str = "config") -> DictConfig:
    """``conf/config.yaml`` composed with these overrides, as ``python -m stare_lightning`` would (no Hydra run);
    ``with_hydra``: keep Hydra's own node (``hydra.*``) in the result."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    register_schema()
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        return hydra_compose(config_name, overrides=list(overrides), return_hydra_config=with_hydra)


def _is_plain_value(text: str) -> bool:
    """A number or a boolean: a sweep over such values cannot name a config file or construct anything."""
    try:
        float(text)
        return True
    except ValueError:
        return text.lower() in ("true", "false", "null")


def _compositions(overrides: Sequence[str]) -> list[list[str]]:
    """Override lists that together compose every config file and value a (multi)run could use: each sweep at
    its first value, then each other non-numeric value of each sweep once (linear in the sweep's size)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(list(overrides))

    def line(override, value: str) -> str:
        prefix = {"ADD": "+", "FORCE_ADD": "++", "DEL": "~"}.get(override.type.name, "")
        return f"{prefix}{override.key_or_group}={value}"

    sweeps = {i: list(o.sweep_string_iterator()) for i, o in enumerate(parsed) if o.is_sweep_override()}
    base = [line(o, sweeps[i][0]) if i in sweeps else o.input_line for i, o in enumerate(parsed)]
    variants = [base]
    for i, values in sweeps.items():
        for value in values[1:]:
            if not _is_plain_value(value):
                variants.append([*base[:i], line(parsed[i], value), *base[i + 1 :]])
    return variants


def check_what_hydra_will_build(overrides: Sequence[str], config_name: str = "config") -> None:
    """Before Hydra starts: every ``_target_`` and every part of Hydra's own node that the run's configs would
    construct is checked (``config/targets.py``), sweeps included. Hydra builds its callbacks, launcher and
    logging before any of the project's code runs, so this is the only moment to refuse them."""
    from omegaconf import OmegaConf

    from stare_lightning.config.moved_keys import check_override_keys
    from stare_lightning.config.targets import check_hydra_node, check_opt_ins, check_targets
    from stare_lightning.rollout.config import check_staleness_overrides

    check_override_keys(overrides)
    check_staleness_overrides(overrides)
    for variant in _compositions(overrides):
        with _explained(variant, config_name):
            composed = compose(variant, with_hydra=True, config_name=config_name)
        _refuse_keys_not_in_schema(composed, variant, config_name)
        # Unresolved: Hydra's runtime values do not exist yet (an interpolated _target_ matches no name: refused).
        tree = OmegaConf.to_container(composed, resolve=False)
        allowed = list(tree.get("allowed_targets") or [])
        check_opt_ins(allowed)
        check_hydra_node(tree.get("hydra"), allowed)
        check_targets({k: v for k, v in tree.items() if k != "hydra"}, allowed)


@contextlib.contextmanager
def _explained(overrides: Sequence[str], config_name: str = "config") -> Iterator[None]:
    """A failed composition of ``overrides`` re-raised as one line in this project's words: a moved key's new
    place, an unknown key's closest known ones, a wrong type's needed one (``config/override_errors.py``); any
    other failure as it is."""
    from stare_lightning.config.moved_keys import moved_key_error
    from stare_lightning.config.override_errors import config_groups, in_our_words

    try:
        yield
    except Exception as error:
        told = moved_key_error(error) or in_our_words(
            error, overrides, lambda others: compose(others, config_name=config_name), config_groups(config_dir())
        )
        if told is None:
            raise
        raise told from error


def _refuse_keys_not_in_schema(composed: DictConfig, overrides: Sequence[str], config_name: str) -> None:
    """A key added with ``+`` to a group of the typed schema that has no such field: composition lets it through
    and the run would refuse it in the job, after Hydra started; refused here instead, in the same words."""
    from stare_lightning.config.override_errors import config_groups, unknown_key_error, unknown_schema_key

    extra = unknown_schema_key(composed)
    if extra is not None:
        compose_others = lambda others: compose(others, config_name=config_name)  # noqa: E731
        raise unknown_key_error(extra, overrides, compose_others, config_groups(config_dir()))


def _hydra_output_dir() -> str | None:
    from hydra.core.hydra_config import HydraConfig

    return HydraConfig.get().runtime.output_dir if HydraConfig.initialized() else None


def prepare_config(cfg: DictConfig) -> tuple[DictConfig, RunConfig]:
    """Fill in the output directory and validate every group; nothing heavy has happened yet."""
    from omegaconf import OmegaConf, open_dict

    from stare_lightning.run_config import to_run_config

    cfg = OmegaConf.create(OmegaConf.to_container(cfg, resolve=False))
    with open_dict(cfg):
        if cfg.get("output_dir") is None:
            cfg.output_dir = _hydra_output_dir() or "outputs/run"
        cfg.output_dir = str(Path(cfg.output_dir).resolve())
    OmegaConf.resolve(cfg)
    with _explained(_task_overrides()):
        return cfg, to_run_config(cfg)


def _task_overrides() -> list[str]:
    from hydra.core.hydra_config import HydraConfig

    return list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []


def _relaunch_argv(subcommand: str, output_dir: str) -> None:
    """Make Lightning's DDP children re-enter this subcommand with this job's overrides and directory."""
    overrides = [o for o in _task_overrides() if not o.startswith("output_dir=")]
    sys.argv = [sys.argv[0], subcommand, *overrides, f"output_dir={output_dir}"]


def _refuse_a_finished_sweep_job(subcommand: str, run_cfg: RunConfig) -> None:
    """A sweep job whose directory already holds a run's metrics would append to them: refuse, unless it resumes."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if subcommand != "fit" or not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
        return
    metrics = Path(run_cfg.output_dir) / "logs" / "metrics.csv"
    if metrics.exists() and run_cfg.ckpt_path is None:
        raise ValueError(
            f"sweep job {HydraConfig.get().job.num} would write into {run_cfg.output_dir}, which already holds a "
            f"run ({metrics}); choose a new hydra.sweep.dir, or resume the sweep's jobs with ckpt_path=last"
        )


def _target(subcommand: str) -> Any:
    module, _, function = SUBCOMMANDS[subcommand][0].partition(":")
    return getattr(importlib.import_module(module), function)


def run_plain(subcommand: str, argv: Sequence[str]) -> int:
    """Run an argparse-style subcommand with the arguments after its name; its exit status."""
    if subcommand not in PLAIN_SUBCOMMANDS:
        raise ValueError(f"{subcommand!r} is not a plain subcommand; those are {sorted(PLAIN_SUBCOMMANDS)}")
    return int(_target(subcommand)(list(argv)) or 0)


def run(subcommand: str, cfg: DictConfig) -> Any:
    if subcommand not in SUBCOMMANDS:
        raise ValueError(f"unknown subcommand {subcommand!r}; choose one of {list(SUBCOMMANDS)}")
    if subcommand in PLAIN_SUBCOMMANDS:
        raise ValueError(f"{subcommand!r} takes plain arguments, not a config: use run_plain")
    cfg, run_cfg = prepare_config(cfg)
    _refuse_a_finished_sweep_job(subcommand, run_cfg)
    _relaunch_argv(subcommand, run_cfg.output_dir)
    from stare_lightning import console

    console.configure(verbose=run_cfg.verbose, output_dir=run_cfg.output_dir)  # before vLLM is imported
    return _target(subcommand)(run_cfg)
