"""What each subcommand does with a composed config. Tests call these functions directly."""

from __future__ import annotations

import sys
from pathlib import Path

from omegaconf import DictConfig, OmegaConf, open_dict

from stare_lightning.config.schema import RunConfig, to_run_config


def _hydra_output_dir() -> str | None:
    from hydra.core.hydra_config import HydraConfig

    return HydraConfig.get().runtime.output_dir if HydraConfig.initialized() else None


def prepare_config(cfg: DictConfig) -> tuple[DictConfig, RunConfig]:
    """Fill in the output directory and validate every group; nothing heavy has happened yet."""
    cfg = OmegaConf.create(OmegaConf.to_container(cfg, resolve=False))
    with open_dict(cfg):
        if cfg.get("output_dir") is None:
            cfg.output_dir = _hydra_output_dir() or "outputs/run"
        cfg.output_dir = str(Path(cfg.output_dir).resolve())
    OmegaConf.resolve(cfg)
    return cfg, to_run_config(cfg)


def _relaunch_argv(subcommand: str, output_dir: str) -> None:
    """Make Lightning's DDP children re-enter this subcommand with this job's overrides and directory."""
    from hydra.core.hydra_config import HydraConfig

    overrides = list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []
    overrides = [o for o in overrides if not o.startswith("output_dir=")]
    sys.argv = [sys.argv[0], subcommand, *overrides, f"output_dir={output_dir}"]


def run(subcommand: str, cfg: DictConfig):
    cfg, run_cfg = prepare_config(cfg)
    _relaunch_argv(subcommand, run_cfg.output_dir)
    from stare_lightning import train

    if subcommand == "fit":
        return train.fit(run_cfg)
    if subcommand == "validate":
        return train.validate(run_cfg)
    if subcommand == "sft":
        return train.prepare_model(run_cfg)
    if subcommand == "export":
        return train.export(run_cfg)
    raise ValueError(f"unknown subcommand {subcommand!r}")
