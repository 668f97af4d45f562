"""``python -m stare_lightning {fit,validate,sft,export} [hydra overrides...]`` and ``... prepare [arguments]``.

Each subcommand (the table ``cli.SUBCOMMANDS``) is its own Hydra entry over the same config tree, except the
argparse-style ones in ``cli.PLAIN_SUBCOMMANDS``, which get their arguments and never start Hydra. Lightning
re-launches DDP/FSDP children as ``python -m stare_lightning <argv>``, so the subcommand stays the first
argument: the entry restores it (with this job's overrides and output directory) before the Trainer starts.
"""

from __future__ import annotations

import os
import sys

from stare_lightning import cli, collector  # light: the schema, Hydra and training code load when a subcommand runs
from stare_lightning.cli import config_dir

__all__ = ["config_dir", "main"]


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in cli.SUBCOMMANDS:
        print(cli.usage(), file=sys.stderr)
        if argv and argv[0] not in ("-h", "--help"):
            print(f"unknown subcommand {argv[0]!r}; choose one of {list(cli.SUBCOMMANDS)}", file=sys.stderr)
            raise SystemExit(2)
        raise SystemExit(0 if argv else 2)
    from stare_lightning import user_errors

    subcommand, overrides = argv[0], argv[1:]
    if subcommand in cli.PLAIN_SUBCOMMANDS:
        raise SystemExit(user_errors.reported(lambda: cli.run_plain(subcommand, overrides)))
    if "--help" in overrides or "-h" in overrides:  # ours, not Hydra's (its help prints the whole config as YAML)
        from stare_lightning.config_help import fit_help

        print(fit_help(subcommand))
        raise SystemExit(0)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # no per-step INFO lines from weight syncs

    import hydra

    cli.register_schema()  # conf/config.yaml's first default is the typed schema
    user_errors.reported(lambda: _check_before_hydra(overrides), verbose="verbose=true" in overrides)

    def job(cfg) -> None:
        user_errors.reported(lambda: cli.run(subcommand, cfg), verbose=user_errors.is_verbose(cfg))
        # Nothing is returned: Hydra keeps each job's return value until the sweep ends, and a trainer holds the
        # models, optimizer state and engine of its run (gigabytes per job in a sweep); thawed, they go now, before
        # a sweep's next job (a single run's go at the exit's collection).
        collector.thaw(collect=_in_a_sweep())

    entry = hydra.main(version_base="1.3", config_path=config_dir(), config_name="config")(job)
    sys.argv = [sys.argv[0], *argv[1:]]
    entry()


def _in_a_sweep() -> bool:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return HydraConfig.get().mode == RunMode.MULTIRUN


def _check_before_hydra(argv: list[str]) -> None:
    """Refuse, before Hydra acts on anything, what would let a config run code: Hydra's pickled-config rerun,
    config directories other than the project's, and any target outside the allow-list (sweeps included)."""
    from hydra._internal.utils import get_args_parser

    args = get_args_parser().parse_args(argv)
    if args.experimental_rerun is not None:
        raise ValueError(
            f"--experimental-rerun {args.experimental_rerun} is refused: it unpickles a saved config, which can "
            "run code; rerun with the overrides in that run's .hydra/overrides.yaml instead"
        )
    if args.config_path is not None or args.config_dir is not None:
        raise ValueError(
            "--config-path/--config-dir are not supported: put experiment files under conf/experiment/ "
            "(or pass overrides); every config the run composes is checked before it starts"
        )
    if args.help or args.hydra_help or args.shell_completion or args.info:
        return
    cli.check_what_hydra_will_build(args.overrides, config_name=args.config_name or "config")


if __name__ == "__main__":
    main()
