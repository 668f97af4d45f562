"""Data recipes: the public releases of the paper's data sets -> this project's prompt records.

``prepare(name, src, out, **options)`` reads a release (with ``datasets``), converts each row through the
recipe's table entry (``table.RECIPES``: the expected columns, the prompt, the normalised answer, the id),
checks the result with ``load_records`` and writes JSONL. ``python -m stare_lightning prepare`` is
``command.main``; ``prepare --list`` prints every recipe with the columns it expects.
"""

from __future__ import annotations

from .command import describe_recipes, main
from .prepare import Summary, prepare, run_recipe
from .table import PAPER_SUFFIX, RECIPES, Layout, Recipe, get_recipe

__all__ = [
    "PAPER_SUFFIX",
    "RECIPES",
    "Layout",
    "Recipe",
    "Summary",
    "describe_recipes",
    "get_recipe",
    "main",
    "prepare",
    "run_recipe",
]
