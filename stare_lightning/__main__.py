"""``python -m stare_lightning {fit,validate,sft,export} [hydra overrides...]``.

Each subcommand is its own Hydra entry over the same config tree. Lightning re-launches DDP/FSDP
children as ``python -m stare_lightning <argv>``, so the subcommand stays the first argument: the
entry restores it (with this job's overrides and output directory) before the Trainer starts.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

SUBCOMMANDS = ("fit", "validate", "sft", "export")


def config_dir() -> str:
    """``conf/`` beside the package (editable install) or inside it (wheel)."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "conf", here.parent / "conf"):
        if (candidate / "config.yaml").is_file():
            return str(candidate)
    raise FileNotFoundError(f"no conf/config.yaml next to {here}")


def _usage() -> str:
    return (
        "usage: python -m stare_lightning {" + ",".join(SUBCOMMANDS) + "} [key=value ...] [-m for sweeps]\n"
        "  fit       train (default: STARE-O1, built-in tiny model, countdown, offline)\n"
        "  validate  evaluate a checkpoint: ckpt_path=... (or the starting policy)\n"
        "  sft       prepare the built-in tiny model's supervised cold start (cached)\n"
        "  export    write a Hugging Face directory from a checkpoint: ckpt_path=... export_dir=..."
    )


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in SUBCOMMANDS:
        print(_usage(), file=sys.stderr)
        if argv and argv[0] not in ("-h", "--help"):
            print(f"unknown subcommand {argv[0]!r}; choose one of {list(SUBCOMMANDS)}", file=sys.stderr)
            raise SystemExit(2)
        raise SystemExit(0 if argv else 2)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # no per-step INFO lines from weight syncs

    import hydra

    from stare_lightning import cli  # registers the config schema with Hydra

    subcommand = argv[0]
    entry = hydra.main(version_base="1.3", config_path=config_dir(), config_name="config")(
        lambda cfg: cli.run(subcommand, cfg)
    )
    sys.argv = [sys.argv[0], *argv[1:]]
    entry()


if __name__ == "__main__":
    main()
