"""``python -m stare_lightning prepare NAME --src PATH... --out PATH [options]`` and ``prepare --list``.

Plain argparse, no Hydra: ``main(argv)`` returns the exit status (0 done, 1 bad data or options, 2 usage).
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from collections.abc import Sequence

from .prepare import VERIFIER, run_recipe
from .table import PAPER_SUFFIX, RECIPES

PROG = "python -m stare_lightning prepare"


def describe_recipes(width: int = 100) -> str:
    """The recipes, the releases each follows and the columns each expects (``prepare --list``)."""
    lines = [f"recipes (records use the {VERIFIER!r} verifier; metadata.data_source = the recipe name):", ""]
    for recipe in RECIPES.values():
        defaults = f"default split {recipe.split!r}" + (
            f", hub config {recipe.hub_config!r}" if recipe.hub_config else ""
        )
        lines.append(f"{recipe.name}  ({defaults})")
        lines += textwrap.wrap(
            recipe.doc, width, initial_indent="    ", subsequent_indent="    ", break_on_hyphens=False
        )
        lines.append("    columns (problem, answer), first match wins:")
        for layout in recipe.layouts:
            lines += textwrap.wrap(
                layout.describe(),
                width,
                initial_indent="      - ",
                subsequent_indent="        ",
                break_on_hyphens=False,
            )
        lines.append("")
    lines.append(f"--suffix paper appends, after a blank line: {PAPER_SUFFIX}")
    return "\n".join(lines)


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Turn a public data set release into prompt records (JSONL) for data=files.",
        epilog=f"example: {PROG} aime24 --src aime_2024/train.parquet --out data/aime24.jsonl --suffix paper",
    )
    parser.add_argument("name", nargs="?", metavar="NAME", help=f"recipe: {', '.join(RECIPES)}")
    parser.add_argument("--src", nargs="+", metavar="PATH", help="parquet/JSON/JSONL file(s), datasets dir or hub id")
    parser.add_argument("--out", metavar="PATH", help="the .jsonl file to write")
    parser.add_argument(
        "--suffix", choices=["none", "paper"], default="none", help="paper: append the short-CoT instruction"
    )
    parser.add_argument("--plain", action="store_true", help="write a plain 'prompt' instead of one user message")
    parser.add_argument("--limit", type=_positive, metavar="N", help="keep the first N records")
    parser.add_argument("--force", action="store_true", help="overwrite an existing --out")
    parser.add_argument("--split", help="split of a hub id or datasets directory (default: the recipe's)")
    parser.add_argument("--config", help="config of a hub id (default: the recipe's, if any)")
    parser.add_argument("--list", action="store_true", help="show the recipes and the columns each expects")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    except SystemExit as exc:  # --help, or a usage error argparse has printed
        return int(exc.code or 0)
    if args.list:
        print(describe_recipes())
        return 0
    if not (args.name and args.src and args.out):
        parser.print_usage(sys.stderr)
        print(f"{PROG}: error: NAME, --src and --out are required (or --list)", file=sys.stderr)
        return 2
    try:
        summary = run_recipe(
            args.name,
            args.src,
            args.out,
            suffix=args.suffix,
            plain=args.plain,
            limit=args.limit,
            force=args.force,
            split=args.split,
            config=args.config,
        )
    except (ValueError, OSError) as exc:  # DataError is a ValueError; FileExistsError an OSError
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 1
    print(summary.line())
    return 0
