"""The commands README.md, docs/getting-started.md and the extending and TRL guides tell a reader to type, checked as
far as a test can cheaply.

Every line of every shell block on those pages, and every inline code span there that starts a command, is taken
apart like a shell would (comments dropped, ``&&`` split, ``VAR=value`` prefixes set aside) and checked by what it
runs:

- ``make TARGET [VAR=value]``: the target is one of the Makefile's and the variable one it reads;
- ``. .venv/bin/activate``: the Makefile's own ``VENV``; every page activates it before its first ``python`` or
  ``jupyter`` command, and no page spells out ``.venv/bin/python`` (one convention everywhere);
- ``python -m stare_lightning SUBCOMMAND overrides...``: the subcommand exists, the overrides pass the checks made
  before Hydra starts, and every configuration they compose (each value of a sweep) passes the run's schema, as the
  command line would build it, with nothing trained; ``prepare``'s arguments go through its parser;
- ``python -m MODULE`` and ``python FILE``: the module imports, the file exists; a module that hands over to
  ``stare_lightning``'s command line (``my_project.run``) has its arguments checked as that command line's;
- ``python -c CODE``: run, in the page's folder (below), with the page's ``PYTHONPATH``;
- ``$(COMMAND)`` as an argument: COMMAND is run (it prints what the argument stands for) and must succeed;
- ``export PYTHONPATH=...``: later commands of the page run with it (``$PWD`` being the checkout), and those that
  import it are checked in a process of their own, as the reader's shell would run them;
- ``pip``: the wheel is built alone (``--no-deps``), installs name the checkout (``-e .``, with extras
  pyproject.toml declares) or the wheel that line built, without pulling other dependencies over the environment;
- ``jupyter execute NOTEBOOK``: the environment has ``jupyter-execute`` and the notebook exists;
- ``git clone <this repository> NAME && cd NAME``: NAME is the project's name.

Each page runs in a temporary folder of its own standing in for the checkout's root (what its commands write lands
there, not in the repository); files and modules are looked up in the checkout. The TRL guide's script is checked
this cheaply (its file exists, the model directory it is given is built): ``tests/test_integrations_docs.py`` runs it.

A command this file has no check for fails the test: teach it the command rather than skip it.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = ("README.md", "docs/getting-started.md", "docs/guides/extending.md", "docs/guides/trl.md")
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
        if words[:3] == ["python", "-m", "stare_lightning"] and len(words) == 3:  # the command line's name in prose
            continue
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
        assert arguments[:1] == ["clone"] and arguments[-1] == "stare_lightning", (
            f"git {arguments}: clone into the name"
        )
        state["cloned"] = True
    elif program == "cd":
        assert state.get("cloned") and arguments == ["stare_lightning"], f"cd {arguments} after no clone"
    elif program == "export":
        check_export(arguments, state)
    elif program == "pip":
        assert state.get("activated"), "pip before the page says to activate the environment"
        check_pip(arguments, state)
    elif program == "jupyter":
        assert state.get("activated"), "jupyter before the page says to activate the environment"
        assert arguments[:1] == ["execute"], f"`jupyter {arguments[0]}`: the install provides `jupyter execute` only"
        assert (Path(sys.executable).parent / "jupyter-execute").is_file(), "jupyter-execute is not installed"
        notebooks = [a for a in arguments[1:] if not a.startswith("-")]
        assert notebooks and all((REPO / n).is_file() for n in notebooks), f"no such notebook: {notebooks}"
    elif program == "python":
        assert state.get("activated"), "python before the page says to activate the environment"
        for argument in arguments:
            if argument.startswith("$(") and argument.endswith(")"):
                check_substitution(argument[2:-1], state)
        if arguments[0] == "-c":
            run_python(arguments, state)
        elif state.get("pythonpath"):  # checked with the page's others, in one process (check_in_a_process)
            state.setdefault("in_a_process", []).append(arguments)
        else:
            check_python(arguments)
    else:
        raise AssertionError(f"no check for {program!r}: teach {Path(__file__).name} what it runs")


_CHECK_IN_A_PROCESS = """
import json, sys
from tests.test_docs_commands import check_python
failures = []
for arguments in json.loads(sys.argv[1]):
    try:
        check_python(arguments)
    except (Exception, SystemExit) as error:
        why = (str(error) or " ").splitlines()[0]
        failures.append(f"python {' '.join(arguments)}\\n    {type(error).__name__}: {why}")
print(json.dumps(failures))
"""


def check_in_a_process(state: dict) -> list[str]:
    """The page's python commands that came after its ``export PYTHONPATH=...``, checked in one process that has
    that PYTHONPATH, as the reader's shell runs them (their imports register the reader's entries); the failures."""
    import json

    if not state.get("in_a_process"):
        return []
    printed = run_python(["-c", _CHECK_IN_A_PROCESS, json.dumps(state["in_a_process"])], state)
    return json.loads(printed.strip().splitlines()[-1])


def _environment(state: dict) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), *state.get("pythonpath", [])])}


def run_python(arguments: list[str], state: dict) -> str:
    """Run ``python ARGUMENTS`` in the page's folder with its PYTHONPATH; what it printed."""
    done = subprocess.run(
        [sys.executable, *arguments],
        cwd=state.get("cwd", REPO),
        env=_environment(state),
        capture_output=True,
        text=True,
        timeout=300,
    )
    errors = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 0, f"exit status {done.returncode}: {errors[-1] if errors else ''}"
    return done.stdout


def check_substitution(command: str, state: dict) -> None:
    """``$(COMMAND)``: a python command that prints a path (the tiny model's directory) and succeeds."""
    words = shlex.split(command)
    assert words[:1] == ["python"], f"$({command}): no check for {words[:1]}"
    printed = run_python(words[1:], state).strip()
    assert printed and Path(printed).exists(), f"$({command}) printed {printed!r}, not a path that exists"


def check_export(arguments: list[str], state: dict) -> None:
    name, _, value = arguments[0].partition("=") if len(arguments) == 1 else ("", "", "")
    assert name == "PYTHONPATH", f"export {arguments}: only PYTHONPATH=... has a check"
    paths = [part.replace("$PWD", str(REPO)) for part in value.split(os.pathsep) if part]
    assert paths and all(Path(path).is_dir() for path in paths), f"PYTHONPATH={value}: not folders of the checkout"
    state["pythonpath"] = paths


def project_metadata() -> dict:
    """pyproject.toml's name, version and extras (read by pattern: tomllib is not in Python 3.10)."""
    text = (REPO / "pyproject.toml").read_text()
    extras_table = text.split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
    return {
        "name": re.search(r'^name = "([^"]+)"', text, re.MULTILINE)[1],
        "version": re.search(r'^version = "([^"]+)"', text, re.MULTILINE)[1],
        "optional-dependencies": re.findall(r"^([\w-]+) = \[", extras_table, re.MULTILINE),
    }


def check_pip(arguments: list[str], state: dict) -> None:
    project = project_metadata()
    wheel = f"dist/{project['name']}-{project['version']}-py3-none-any.whl"
    if arguments[:1] == ["wheel"]:
        assert "--no-deps" in arguments, "pip wheel without --no-deps builds a wheel of every dependency too"
        assert arguments[-1] == "." and arguments[arguments.index("-w") + 1] == "dist", f"pip {arguments}"
        state["wheel"] = wheel
        return
    assert arguments[:1] == ["install"], f"pip {arguments}: no check"
    target = arguments[-1]
    if target.endswith(".whl"):
        assert target == state.get("wheel"), f"installs {target}, not the wheel the page built ({wheel})"
        assert "--no-deps" in arguments, "installing the wheel with its dependencies would replace the environment's"
        return
    assert arguments[-2] == "-e", f"pip {arguments}: install the checkout, e.g. -e ., not an index's package"
    checkout, _, extras = target.partition("[")
    assert checkout == ".", f"-e {target}: the checkout is ."
    unknown = set(extras.rstrip("]").split(",")) - set(project["optional-dependencies"]) - {""}
    assert not unknown, f"pyproject.toml declares no extra {sorted(unknown)}"


def check_python(arguments: list[str]) -> None:
    if arguments[0] != "-m":
        assert (REPO / arguments[0]).is_file(), f"no such file: {arguments[0]}"
        return
    module, rest = arguments[1], arguments[2:]
    if module != "stare_lightning":
        assert importlib.util.find_spec(module) is not None, f"no module {module}"
        if module.split(".")[0] != "stare_lightning" and rest:
            from stare_lightning.__main__ import main

            # A command line of the reader's own (my_project.run): importing it registers its entries.
            assert getattr(importlib.import_module(module), "main", None) is main, f"{module} takes no check"
            check_python(["-m", "stare_lightning", *rest])
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
def test_every_command_on_the_page_is_one_that_works(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # what the page's commands write lands here
    state: dict = {"cwd": tmp_path}
    text = (REPO / page).read_text()
    failures = []
    # Shell blocks in page order, then the inline commands (which read after the page's install block).
    for snippet in [*shell_blocks(text), *inline_commands(text)]:
        for words in commands(snippet):
            try:
                check(words, state)
            except (Exception, SystemExit) as error:  # whatever stops the command
                failures.append(f"{shlex.join(words)}\n    {type(error).__name__}: {str(error).splitlines()[0]}")
    failures += check_in_a_process(state)
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
        (". .venv/bin/activate && pip install stare_lightning", "install the checkout"),
        (". .venv/bin/activate && pip install -e '.[nope]'", "no extra ['nope']"),
        (". .venv/bin/activate && pip wheel -w dist .", "without --no-deps"),
        (". .venv/bin/activate && pip install --no-deps dist/other-1.0-py3-none-any.whl", "not the wheel"),
        ("export FOO=1", "only PYTHONPATH"),
        ("export PYTHONPATH=$PWD/docs/nowhere", "not folders of the checkout"),
        (". .venv/bin/activate && python -c 'raise SystemExit(3)'", "exit status 3"),
        (". .venv/bin/activate && python x.py \"$(python -c 'print(1)')\"", "not a path that exists"),
        (". .venv/bin/activate && python -m json.tool x", "json.tool takes no check"),
        ("git clone <this repository> && cd stare_lightning", "clone into the name"),
        ("rm -rf outputs", "no check for 'rm'"),
    ],
)
def test_the_checks_refuse_what_does_not_work(snippet, complaint, tmp_path):
    state: dict = {"cwd": tmp_path}
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
