"""The commands README.md and docs/getting-started.md tell a newcomer to type, checked as far as a test can cheaply.

Every line of every shell block on those pages, and every inline code span there that starts a command, is taken
apart like a shell would (comments dropped, ``&&`` split, ``VAR=value`` prefixes set aside) and checked by what it
runs:

- ``make TARGET [VAR=value]``: the target is one of the Makefile's and the variable one it reads;
- ``. .venv/bin/activate``: the Makefile's own ``VENV``; every page activates it before its first ``python`` or
  ``jupyter`` command, and no page spells out ``.venv/bin/python`` (one convention everywhere);
- ``python -m stare_lightning SUBCOMMAND overrides...``: the subcommand exists, the overrides pass the checks made
  before Hydra starts, and every configuration they compose (each value of a sweep) passes the run's schema, as the
  command line would build it, with nothing trained; ``prepare``'s arguments go through its parser;
- ``python -m MODULE`` and ``python FILE``: the module imports, the file exists;
- ``jupyter execute NOTEBOOK``: the environment has ``jupyter-execute`` and the notebook exists;
- ``git clone <this repository> && cd NAME``: NAME is the project's name.

A command this file has no check for fails the test: teach it the command rather than skip it.
"""

from __future__ import annotations

import importlib.util
import re
import shlex
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = ("README.md", "docs/getting-started.md")
SHELLS = ("bash", "sh", "shell", "console")
FENCE = re.compile(r"^([ \t]*)```(\w*)[^\n]*\n(.*?)^[ \t]*```", re.MULTILINE | re.DOTALL)  # list items indent
ENVIRONMENT = re.compile(r"^[A-Z_][A-Z0-9_]*=")


def shell_blocks(markdown: str) -> list[str]:
    return [textwrap.dedent(body) for _, language, body in FENCE.findall(markdown) if language in SHELLS]


def inline_commands(markdown: str) -> list[str]:
    """Inline code spans outside fenced blocks that start with ``python`` or ``jupyter`` (after any ``VAR=value``
    prefixes), but for patterns such as ``python -m stare_lightning ...``."""
    prose = FENCE.sub("", markdown)
    found = []
    for span in re.findall(r"`([^`\n]+)`", prose):
        words = span.split()
        while words and ENVIRONMENT.match(words[0]):
            words = words[1:]
        if words and words[0] in ("python", "jupyter") and len(words) > 1 and "..." not in span:  # not a pattern
            found.append(span)
    return found


def commands(text: str) -> list[list[str]]:
    """The simple commands of a shell snippet: lines joined at ``\\``, comments dropped, split at ``&&``."""
    found: list[list[str]] = []
    for line in text.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        current: list[str] = []
        for word in [*words, "&&"]:
            if word == "&&":
                if current:
                    found.append(current)
                current = []
            else:
                current.append(word)
    return found


def makefile() -> tuple[set[str], set[str], str]:
    """The Makefile's targets, the variables it reads, and its ``VENV``."""
    text = (REPO / "Makefile").read_text()
    targets = set(re.findall(r"^([A-Za-z][\w.-]*)\s*:(?!=)", text, re.MULTILINE))
    variables = set(re.findall(r"\$\(([A-Z_][A-Z0-9_]*)\)", text))
    venv = re.search(r"^VENV \?= (\S+)$", text, re.MULTILINE).group(1)
    return targets, variables, venv


def check(words: list[str], state: dict) -> None:
    """Raise AssertionError naming what is wrong with one simple command (``state`` carries what came before)."""
    while words and ENVIRONMENT.match(words[0]):
        words = words[1:]
    assert words, "an environment assignment alone"
    program, arguments = words[0], words[1:]
    targets, variables, venv = makefile()
    if program == "make":
        for argument in arguments:
            if "=" in argument:
                assert argument.split("=")[0] in variables, f"the Makefile reads no variable {argument}"
            else:
                assert argument in targets, f"the Makefile has no target {argument!r}"
    elif program in (".", "source"):
        assert arguments == [f"{venv}/bin/activate"], f"activates {arguments}, not the Makefile's {venv}"
        state["activated"] = True
    elif program == "git":
        assert arguments[:1] == ["clone"], f"git {arguments}"
        state["cloned"] = True
    elif program == "cd":
        assert state.get("cloned") and arguments == ["stare_lightning"], f"cd {arguments} after no clone"
    elif program == "jupyter":
        assert state.get("activated"), "jupyter before the page says to activate the environment"
        assert arguments[:1] == ["execute"], f"`jupyter {arguments[0]}`: the install provides `jupyter execute` only"
        assert (Path(sys.executable).parent / "jupyter-execute").is_file(), "jupyter-execute is not installed"
        notebooks = [a for a in arguments[1:] if not a.startswith("-")]
        assert notebooks and all((REPO / n).is_file() for n in notebooks), f"no such notebook: {notebooks}"
    elif program == "python":
        assert state.get("activated"), "python before the page says to activate the environment"
        check_python(arguments)
    else:
        raise AssertionError(f"no check for {program!r}: teach {Path(__file__).name} what it runs")


def check_python(arguments: list[str]) -> None:
    if arguments[0] != "-m":
        assert (REPO / arguments[0]).is_file(), f"no such file: {arguments[0]}"
        return
    module, rest = arguments[1], arguments[2:]
    if module != "stare_lightning":
        assert importlib.util.find_spec(module) is not None, f"no module {module}"
        return
    from stare_lightning import cli

    subcommand, overrides = rest[0], rest[1:]
    assert subcommand in cli.SUBCOMMANDS, f"no subcommand {subcommand!r}"
    if subcommand in cli.PLAIN_SUBCOMMANDS:
        from stare_lightning.data.recipes.command import build_parser

        build_parser().parse_args(overrides)
        return
    check_overrides(overrides)


def check_overrides(argv: list[str]) -> None:
    """What ``python -m stare_lightning fit <argv>`` checks before Hydra starts, then the run's schema on every
    configuration the overrides compose (each sweep value), as the command line builds it."""
    from hydra._internal.utils import get_args_parser

    from stare_lightning import cli
    from stare_lightning.__main__ import _check_before_hydra

    _check_before_hydra(argv)
    for variant in cli._compositions(get_args_parser().parse_args(argv).overrides):
        cli.prepare_config(cli.compose(variant))


@pytest.mark.parametrize("page", PAGES)
def test_every_command_on_the_page_is_one_that_works(page):
    state: dict = {}
    text = (REPO / page).read_text()
    failures = []
    # Shell blocks in page order, then the inline commands (which read after the page's install block).
    for snippet in [*shell_blocks(text), *inline_commands(text)]:
        for words in commands(snippet):
            try:
                check(words, state)
            except (Exception, SystemExit) as error:  # whatever stops the command
                failures.append(f"{shlex.join(words)}\n    {type(error).__name__}: {str(error).splitlines()[0]}")
    assert not failures, f"{page}:\n" + "\n".join(failures)
    assert state.get("activated"), f"{page} never says to activate {makefile()[2]}"


def test_the_pages_write_python_one_way():
    """Activated once, the environment's programs are plain ``python`` and ``jupyter``; the install has no
    Jupyter Lab and no nbconvert (``jupyter execute`` comes with nbclient)."""
    unwanted = (".venv/bin/python", "jupyter lab", "jupyter nbconvert", "jupyter notebook")
    spelled = [
        f"{path.relative_to(REPO)}: {word}"
        for path in [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
        for word in unwanted
        if word in path.read_text()
    ]
    assert not spelled, f"pages that write what the install does not provide or bypass the activation: {spelled}"


@pytest.mark.parametrize(
    ("snippet", "complaint"),
    [
        ("python -m stare_lightning fit", "before the page says to activate"),
        (". .venv/bin/activate && python -m stare_lightning fit algorithm=nope", "algorithm/nope"),
        (". .venv/bin/activate && python -m stare_lightning fit algorithm.stare.w=-2", "algorithm.stare.w"),
        (". .venv/bin/activate && python -m stare_lightning fit -m algorithm=grpo_ds,nope", "algorithm/nope"),
        (". .venv/bin/activate && python -m stare_lightning fitt", "no subcommand"),
        (". .venv/bin/activate && python -m stare_lightning.nowhere", "no module"),
        (". .venv/bin/activate && python scripts/nowhere.py", "no such file"),
        (". .venv/bin/activate && jupyter lab notebooks/entropy_dynamics.ipynb", "jupyter execute"),
        (". .venv/bin/activate && jupyter execute notebooks/nowhere.ipynb", "no such notebook"),
        ("make runn", "no target"),
        ("make compare SEEDZ=1", "no variable"),
        (". venv/bin/activate", "not the Makefile's"),
        ("pip install stare_lightning", "no check for 'pip'"),
    ],
)
def test_the_checks_refuse_what_does_not_work(snippet, complaint):
    state: dict = {}
    with pytest.raises((Exception, SystemExit)) as caught:
        for words in commands(snippet):
            check(words, state)
    assert complaint in str(caught.value)


def test_snippets_are_split_like_a_shell_splits_them():
    snippet = "make run    # set up .venv\nSTARE_RUN_DIRS=a:b python -m x \\\n  y=1 && make test\n# a comment\n"
    assert commands(snippet) == [["make", "run"], ["STARE_RUN_DIRS=a:b", "python", "-m", "x", "y=1"], ["make", "test"]]
    markdown = (
        "```bash\nmake run\n```\n\n1. item\n\n    ```bash\n    make test\n    ```\n\n"
        "`python -m stare_lightning fit`, `A=1 jupyter execute x` or `make`, not `python -m stare_lightning ...`.\n"
    )
    assert shell_blocks(markdown) == ["make run\n", "make test\n"]
    assert inline_commands(markdown) == ["python -m stare_lightning fit", "A=1 jupyter execute x"]


def test_after_the_activation_the_first_command_runs_through_a_real_shell(tmp_path):
    """The activation line and a command of the pages, run by bash from a directory outside the checkout (Hydra's
    ``--cfg job`` prints the composed job and trains nothing), with a PATH that holds no other Python first."""
    import os
    import subprocess

    activate = Path(sys.executable).parent / "activate"
    if not activate.is_file():
        pytest.skip(f"{sys.executable} is not in a virtual environment with an activate script")
    script = f". {shlex.quote(str(activate))} && python -m stare_lightning fit algorithm=grpo_ds --cfg job"
    env = {"PATH": "/usr/bin:/bin", "HOME": os.environ.get("HOME", str(tmp_path)), "PYTHONDONTWRITEBYTECODE": "1"}
    done = subprocess.run(["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "  name: grpo_ds\n" in done.stdout and "dynamic_sampling: true" in done.stdout  # the override took
    assert not any(tmp_path.iterdir()), "--cfg job wrote files"
