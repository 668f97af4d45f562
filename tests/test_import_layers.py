"""The package's import graph: no cycle among its modules, and no import that goes up the layers written down here.

Every import statement counts, at module level and inside functions (an import in a function runs as surely as one
at the top, only later). Imports under ``if TYPE_CHECKING:`` never run and are left out of the layers, but not of the
cycles: two modules that name each other's types cannot be read or moved apart, whether or not the import runs.
``from pkg import name`` is an edge to ``pkg.name`` when that is a module of the package, else to ``pkg`` itself. A
package's lazy exports (``lazy_exports(__name__, {module: names})``) are edges to the modules they name: asking for
the name imports them. Importing a submodule also runs its parents' ``__init__``, which is not counted: it would tie
every package to its own ``__init__`` both ways.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "stare_lightning"

# Low to high: a module may import from its own layer and the layers before it, never from a later one. Each entry
# names modules by dotted prefix (a package and everything in it); a module takes the layer of its longest prefix.
# The order is the one the code has, written down: where it reads against intuition, the comment says why.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    # Imports nothing of the package.
    (
        "foundation",
        (
            "stare_lightning",
            "user_errors",
            "console",
            "distributed",
            "allocator",
            "collector",
            "lazy_exports",
            "seeds",
            "config",
            "run_folder",
        ),
    ),
    # Self-contained parts: each needs the foundation only.
    ("parts", ("tools", "trainer", "algorithms", "metrics")),
    # STARE for a caller's own loop and for TRL: the algorithms and their telemetry, nothing of this trainer.
    ("integrations", ("integrations",)),
    # rewards: the verifier worker's seccomp filter is tools.seccomp's; models: export vets checkpoints with
    # trainer.checkpoint_trust.
    ("rewards and models", ("rewards", "models")),
    # The engines load LoRA adapters (models.lora) and run tool episodes (tools).
    ("rollout", ("rollout",)),
    # Records name their verifier (rewards.registry) and benchmarks carry their own sampling (rollout.config).
    ("data", ("data",)),
    ("step", ("step",)),
    # The run's schema gathers every part's config, the step's included.
    ("run config", ("run_config",)),
    ("module", ("module",)),
    # What reads finished runs: nothing of training may depend on it.
    ("analysis", ("analysis",)),
    # The end-of-fit summary plots the run it closes (analysis).
    ("callbacks", ("callbacks",)),
    ("train", ("train",)),
    # Commands: what a user runs. config_reference documents the schema as the command line composes it.
    ("commands", ("cli", "__main__", "compare", "evaluation", "config_reference", "config_help", "serve")),
]

# Cycles tolerated for now, each with the change it waits for (none today). Any other cycle fails, and so does an
# entry here that no longer matches a cycle of the code.
KNOWN_CYCLES: dict[frozenset[str], str] = {}

# Modules that only the modules listed may import, each with the reason. The LightningModule is assembled from the
# composed config in one place (``train.py``: data first, then the tool, the model, the module), so that ``fit``,
# ``validate`` and ``evaluate`` cannot drift apart in how they build it; a command that needs one asks ``train``.
ONLY_IMPORTED_BY: dict[str, frozenset[str]] = {
    "stare_lightning.module": frozenset({"stare_lightning.train"}),
}

# Imports ruled out inside a layer: (importers, what they may not import, importers left out, why). Each side is a
# dotted prefix below the package's name, as in LAYERS.
FORBIDDEN: list[tuple[str, str, str | None, str]] = [
    (
        "rollout",
        "rollout.server",
        "rollout.server",
        "rollout/server/ is one backend's; the rest of rollout/ names it only in its registry entry (a string)",
    ),
    (
        "rollout.server.in_vllm",
        "rollout.server.trainer_side",
        None,
        "code that runs inside a vLLM server must not pull in the trainer's side",
    ),
    ("rollout.server.shared", "rollout.server.trainer_side", None, "both sides import shared/: it takes neither"),
    ("rollout.server.shared", "rollout.server.in_vllm", None, "both sides import shared/: it takes neither"),
]


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules(root: Path) -> dict[str, Path]:
    return {module_name(path, root): path for path in sorted(root.rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_nodes(tree: ast.AST, type_checking: bool = False):
    """Every Import/ImportFrom node, at any depth, but for those under ``if TYPE_CHECKING:`` (kept with
    ``type_checking``)."""
    pending = [tree]
    while pending:
        node = pending.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        children = list(ast.iter_child_nodes(node))
        if isinstance(node, ast.If) and _is_type_checking(node.test) and not type_checking:
            children = node.orelse
        pending.extend(children)


def _absolute(module: str | None, level: int, package: str) -> str:
    """``module`` as named ``level`` dots below ``package`` (level 0: already absolute)."""
    if not level:
        return module or ""
    base = package.split(".")[: len(package.split(".")) - level + 1]
    return ".".join(base + ([module] if module else []))


def _lazy_exports(tree: ast.Module, package: str) -> list[str]:
    """The modules a package's ``lazy_exports(__name__, {module: names})`` imports when a name is first asked for."""
    assigned = {
        target.id: node.value
        for node in tree.body
        if isinstance(node, ast.Assign)
        for target in node.targets
        if isinstance(target, ast.Name)
    }
    found = []
    for node in ast.walk(tree):
        function = getattr(node, "func", None)
        if not isinstance(node, ast.Call) or getattr(function, "id", getattr(function, "attr", None)) != "lazy_exports":
            continue
        exports = node.args[1] if len(node.args) > 1 else None
        exports = assigned.get(exports.id) if isinstance(exports, ast.Name) else exports
        for key in exports.keys if isinstance(exports, ast.Dict) else ():
            if isinstance(key, ast.Constant) and isinstance(key.value, str):
                dotted = key.value.lstrip(".")
                found.append(_absolute(dotted, len(key.value) - len(dotted), package))
    return found


def imports_of(name: str, path: Path, known: dict[str, Path], type_checking: bool = False) -> set[str]:
    """The package's modules that module ``name`` (at ``path``) imports (and names for typing, with
    ``type_checking``)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    top = name.split(".")[0]
    tree = ast.parse(path.read_text(), filename=str(path))
    targets = _lazy_exports(tree, package)
    for node in _import_nodes(tree, type_checking):
        if isinstance(node, ast.Import):
            targets += [alias.name for alias in node.names]
        else:
            source = _absolute(node.module, node.level, package)
            targets += [f"{source}.{a.name}" if f"{source}.{a.name}" in known else source for a in node.names]
    found: set[str] = set()
    for target in targets:
        if target.split(".")[0] != top:
            continue
        while target and target not in known:  # `import pkg.mod.attr` style names: the module that holds them
            target = target.rpartition(".")[0]
        if target and target != name:
            found.add(target)
    return found


def import_graph(root: Path = PACKAGE, type_checking: bool = False) -> dict[str, set[str]]:
    """``module -> the package's modules it imports``; with ``type_checking``, type-only imports too."""
    known = modules(root)
    return {name: imports_of(name, path, known, type_checking) for name, path in known.items()}


def layer_of(name: str, layers=LAYERS) -> int | None:
    """The index of the layer whose longest prefix matches ``name`` (prefixes are below the package's name)."""
    top, _, rest = name.partition(".")
    best, best_length = None, -1
    for index, (_, prefixes) in enumerate(layers):
        for prefix in prefixes:
            if prefix == top:
                matches, length = rest == "", 0  # the package's own __init__ only
            else:
                matches, length = rest == prefix or rest.startswith(prefix + "."), len(prefix)
            if matches and length > best_length:
                best, best_length = index, length
    return best


def upward_imports(graph: dict[str, set[str]], layers=LAYERS) -> list[str]:
    names = [layer for layer, _ in layers]
    found = []
    for source, targets in sorted(graph.items()):
        for target in sorted(targets):
            low, high = layer_of(source, layers), layer_of(target, layers)
            if low is not None and high is not None and high > low:
                found.append(f"{source} ({names[low]}) imports {target} ({names[high]})")
    return found


def restricted_imports(graph: dict[str, set[str]], only_imported_by=ONLY_IMPORTED_BY) -> list[str]:
    """Imports of a module of ``only_imported_by`` from a module it does not list."""
    return [
        f"{source} imports {target}"
        for source, targets in sorted(graph.items())
        for target in sorted(targets)
        if target in only_imported_by and source not in only_imported_by[target]
    ]


def _under(name: str, prefix: str) -> bool:
    rest = name.partition(".")[2]
    return rest == prefix or rest.startswith(prefix + ".")


def forbidden_imports(graph: dict[str, set[str]], rules=FORBIDDEN) -> list[str]:
    """Imports that a rule of ``rules`` rules out, each with the rule's reason."""
    return [
        f"{source} imports {target}: {why}"
        for source, targets in sorted(graph.items())
        for target in sorted(targets)
        for importers, imported, exempt, why in rules
        if _under(source, importers) and _under(target, imported) and not (exempt and _under(source, exempt))
    ]


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def test_every_module_has_a_layer():
    missing = sorted(name for name in modules(PACKAGE) if layer_of(name) is None)
    assert not missing, f"modules in no layer (add their package to LAYERS in {Path(__file__).name}): {missing}"


def test_no_import_goes_up_the_layers():
    upward = upward_imports(import_graph())
    assert not upward, "imports up the layers:\n" + "\n".join(upward)


def test_the_module_is_imported_only_where_allowed():
    found = restricted_imports(import_graph(type_checking=True))
    assert not found, f"imports that ONLY_IMPORTED_BY in {Path(__file__).name} rules out:\n" + "\n".join(found)


def test_no_forbidden_import_inside_a_layer():
    found = forbidden_imports(import_graph(type_checking=True))
    assert not found, f"imports that FORBIDDEN in {Path(__file__).name} rules out:\n" + "\n".join(found)


def test_the_forbidden_rules_catch_what_they_name_and_nothing_else():
    graph = {
        "pkg.rollout.vllm": {"pkg.rollout.server.trainer_side.client", "pkg.rollout.transfer_dir"},
        "pkg.rollout.server.trainer_side.engine": {"pkg.rollout.server.shared.transfer", "pkg.rollout.base"},
        "pkg.rollout.server.in_vllm.auth": {"pkg.rollout.server.shared.token", "pkg.rollout.server.trainer_side.http"},
        "pkg.rollout.server.shared.net_wire": {"pkg.rollout.server.in_vllm.plugin"},
    }
    assert [line.partition(":")[0] for line in forbidden_imports(graph)] == [
        "pkg.rollout.server.in_vllm.auth imports pkg.rollout.server.trainer_side.http",
        "pkg.rollout.server.shared.net_wire imports pkg.rollout.server.in_vllm.plugin",
        "pkg.rollout.vllm imports pkg.rollout.server.trainer_side.client",
    ]


def test_no_import_cycle():
    found = cycles(import_graph(type_checking=True))
    new = [cycle for cycle in found if frozenset(cycle) not in KNOWN_CYCLES]
    assert not new, "import cycles:\n" + "\n".join(" <-> ".join(cycle) for cycle in new)
    gone = [sorted(cycle) for cycle in KNOWN_CYCLES if sorted(cycle) not in found]
    assert not gone, f"KNOWN_CYCLES lists cycles the code no longer has (remove them): {gone}"


def test_the_checker_sees_function_level_relative_and_aliased_imports_and_skips_type_checking(tmp_path):
    """The checks above on a package written here: what each of them must catch, and what it must not."""
    root = tmp_path / "pkg"
    (root / "low").mkdir(parents=True)
    files = {
        "__init__.py": "",
        "low/__init__.py": "from .base import VALUE\n",
        "low/base.py": "VALUE = 1\n",
        # Reaches up only inside a function, and through `from <package> import <module>`.
        "low/late.py": "def f():\n    from pkg.high import helpers\n    return helpers\n",
        # Lazy exports: one absolute, one relative; a name asked for imports its module.
        "high/__init__.py": (
            "from pkg.lazy_exports import lazy_exports\n"
            "_EXPORTS = {'pkg.low.late': ('f',), '..low.base': ('VALUE',)}\n"
            "__getattr__, __dir__, __all__ = lazy_exports(__name__, _EXPORTS)\n"
        ),
        "lazy_exports.py": "def lazy_exports(package, exports):\n    return None, None, []\n",
        "high/helpers.py": "import pkg.low.base as base\nfrom ..low import VALUE\n",
        # A cycle: a imports b at the top, b imports a inside a function.
        "high/a.py": "from pkg.high import b\n",
        "high/b.py": "def g():\n    import pkg.high.a\n",
        # Typing only: never runs, so neither a cycle nor an upward import.
        "low/typed.py": (
            "from typing import TYPE_CHECKING\nimport typing\n"
            "if TYPE_CHECKING:\n    from pkg.high import helpers\n"
            "if typing.TYPE_CHECKING:\n    import pkg.high.a\nelse:\n    from pkg.low import base\n"
        ),
        # A cycle through a type-only import: seen only when type-only imports count.
        "low/watch.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.low.pool import Result\n",
        "low/pool.py": "from pkg.low.watch import Watch\n",
    }
    for relative, text in files.items():
        (root / relative).parent.mkdir(parents=True, exist_ok=True)
        (root / relative).write_text(text)
    graph = import_graph(root)
    assert graph["pkg.low.late"] == {"pkg.high.helpers"}
    assert graph["pkg.high.helpers"] == {"pkg.low.base", "pkg.low"}
    assert graph["pkg.low.typed"] == {"pkg.low.base"}
    assert graph["pkg.low"] == {"pkg.low.base"}
    assert graph["pkg.high"] == {"pkg.lazy_exports", "pkg.low.late", "pkg.low.base"}
    assert cycles(graph) == [["pkg.high.a", "pkg.high.b"]]
    typed = import_graph(root, type_checking=True)
    assert typed["pkg.low.typed"] == {"pkg.low.base", "pkg.high.helpers", "pkg.high.a"}
    assert cycles(typed) == [["pkg.high.a", "pkg.high.b"], ["pkg.low.pool", "pkg.low.watch"]]
    assert restricted_imports(typed, {"pkg.high.a": frozenset({"pkg.high.b"})}) == ["pkg.low.typed imports pkg.high.a"]
    layers = [("low", ("pkg", "low", "lazy_exports")), ("high", ("high",))]
    assert upward_imports(graph, layers) == ["pkg.low.late (low) imports pkg.high.helpers (high)"]
    assert layer_of("pkg.high.a", layers) == 1 and layer_of("pkg", layers) == 0 and layer_of("other", layers) is None
