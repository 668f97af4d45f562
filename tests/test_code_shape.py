"""House rules a reader can rely on: small modules and short functions in the package.

No module over 400 lines and no function over 60 lines (docstring included). A function that must be
longer goes into ``LONG_FUNCTIONS`` with the reason.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "stare_lightning"
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60
LONG_FUNCTIONS: dict[str, str] = {}  # "path/to/module.py::name" -> why it stays long


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_modules_are_short():
    long = {
        str(p.relative_to(PACKAGE)): n for p in _modules() if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"


def test_functions_are_short():
    long = {}
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                key = f"{path.relative_to(PACKAGE)}::{node.name}"
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES and key not in LONG_FUNCTIONS:
                    long[key] = length
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines (split them, or list them with a reason): {long}"


def test_the_lightning_module_only_wires_parts_together():
    text = (PACKAGE / "module.py").read_text()
    assert len(text.splitlines()) <= 250, "module.py: the step's logic belongs in step/, the parts in their packages"
    assert "fmt: skip" not in text, "module.py: no line packing to stay under its cap"


def test_the_step_package_runs_without_lightning():
    for path in sorted((PACKAGE / "step").glob("*.py")):
        imported = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module:
                imported.add(node.module)
        assert not any(name.split(".")[0] == "lightning" for name in imported), path.name
