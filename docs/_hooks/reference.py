"""MkDocs hook: the Reference pages, generated from the code at every build so they cannot drift from it.

- ``reference/configuration.md``: every key of the run's schema (``stare_lightning.config_reference``) and every
  option of every config group (the files of ``conf/``);
- ``reference/metrics.md``: the metric glossary (``stare_lightning.metrics.glossary``);
- ``reference/cli.md``: the subcommands (``stare_lightning.cli.SUBCOMMANDS``) and ``prepare``'s arguments;
- ``reference/api.md``: the extension points (``EXTENSION_POINTS``: the module, the data module, callbacks,
  verifiers, tools, rollout engines, selectors, policy losses), then the public names of ``stare_lightning.algorithms``
  (its ``__all__``), grouped by the module that defines them, for mkdocstrings to render.

The pages exist only in the build (``File.generated``), so ``mkdocs build --strict`` checks their links and
anchors like those of the written pages.
"""

from __future__ import annotations

import os
from collections import defaultdict
from pathlib import Path

from mkdocs.structure.files import File

PAGES = {
    "reference/configuration.md": "configuration_page",
    "reference/metrics.md": "metrics_page",
    "reference/cli.md": "cli_page",
    "reference/api.md": "api_page",
}
GENERATED_NOTE = "*Generated from the code when the site is built ({source}); edit the source, not this page.*"


SUMMARY_MARK = "<!-- summary-example -->"
SUMMARY_RUN = "notebooks/data/default_runs/stare_o1/metrics.csv"


def on_files(files, config):
    for path, builder in PAGES.items():
        files.append(File.generated(config, path, content=globals()[builder]()))
    return files


def on_page_markdown(markdown, page, config, files):
    """``<!-- summary-example -->`` becomes the end-of-fit table, rendered by ``RunSummary`` from a committed log."""
    if SUMMARY_MARK in markdown:
        markdown = markdown.replace(SUMMARY_MARK, f"```text\n{summary_example()}\n```")
    return markdown


def summary_example() -> str:
    """The summary table of a committed run, as the terminal shows it at 80 columns."""
    import csv
    import io

    from rich.console import Console

    from stare_lightning.callbacks import RunSummary

    summary = RunSummary(name="stare_o1")
    with open(Path(__file__).resolve().parents[2] / SUMMARY_RUN) as handle:
        for row in csv.DictReader(handle):
            values = {key: float(value) for key, value in row.items() if value != ""}
            if any(key.startswith("val/") for key in values):
                summary.validations.append({k: v for k, v in values.items() if k.startswith("val/")})
            if any(key.startswith("train/") for key in values):
                summary.train_history.append({k: v for k, v in values.items() if k.startswith("train/")})
    out = io.StringIO()
    Console(file=out, width=80, color_system=None).print(summary.table(len(summary.train_history)))
    return out.getvalue().rstrip()


def _cell(text: str) -> str:
    """Text safe inside a Markdown table cell."""
    return text.replace("|", "\\|").replace("\n", " ")


def _code(text: str) -> str:
    return f"`{text}`" if text else ""


# ------------------------------------------------------------------------------------------ configuration


def configuration_page() -> str:
    from stare_lightning.cli import config_dir
    from stare_lightning.config_reference import config_keys, constructor_keys

    keys = config_keys()
    constructors = constructor_keys()
    plain = [k for k in keys if not k.group]
    lines = [
        "# Configuration reference",
        "",
        GENERATED_NOTE.format(source="the schema dataclasses' field docstrings, their checks and `conf/`"),
        "",
        f"The run's {len(plain)} schema keys, group by group, then the {len(constructors)} keys of the `trainer`, "
        "`callbacks` and `logger` groups. Set any of them on the command line "
        "(`python -m stare_lightning fit optim.lr=1e-5`), in an experiment file or in your own config group. "
        "**default** is the schema's; where the default run (`make run`, `python -m stare_lightning fit`) "
        "composes another value, it follows as *make run: ...*. **allowed** is what the schema's checks accept: "
        "a value outside it fails before anything loads, naming the key. Some keys are also checked together "
        "(a setting that would do nothing is refused, with the reason).",
        "",
        "[Config groups and their options](#config-groups-and-their-options) lists the files each group can be "
        "switched to (`algorithm=grpo_ds`, `trainer=fsdp`, ...).",
        "",
    ]
    sections: dict[str, tuple[str, list]] = {"": ("", [])}  # group key -> (its docstring, its plain keys)
    for key in keys:
        if key.group or key.type == "any":
            sections[key.key] = (key.doc, [] if key.group else None)
            continue
        parent = key.key.rsplit(".", 1)[0] if "." in key.key else ""
        sections[parent.removesuffix("[]")][1].append(key)
    for name, (doc, members) in sections.items():
        level = "##" if "." not in name else "###"
        lines += ["", f"{level} `{name}`" if name else "## Top-level keys", ""]
        if doc:
            lines += [doc, ""]
        if members is None:  # trainer, callbacks, logger: constructor arguments, listed with the group's options
            lines += _constructor_table(name, constructors)
            continue
        if not members:
            continue
        lines += ["| key | type | default | allowed | meaning |", "|---|---|---|---|---|"]
        for key in members:
            default = _code(key.default)
            if key.in_default_run is not None and key.in_default_run != key.default:
                default += f" *(make run: {_code(key.in_default_run)})*"
            lines.append(
                f"| `{key.key}` | {_cell(key.type)} | {_cell(default)} | {_cell(key.allowed)} | {_cell(key.doc)} |"
            )
    lines += ["", *_group_options(Path(config_dir()))]
    return "\n".join(lines) + "\n"


def _constructor_table(group: str, constructors) -> list[str]:
    """The keys of a constructor group: what each option file sets them to and what they mean."""
    lines = [
        "Its keys are the arguments of the class each `_target_` names (checked against the allow-list before "
        "anything is built), so any other argument of that class can be set too, e.g. "
        f"`+{group}.<name>=<value>` for one the option files leave out. Below: every key the option files set, "
        "the value each option gives it, the default run's, and its meaning from the class's own documentation "
        "(*Here:* the option file's comment).",
        "",
        "| key | set by the options | make run | meaning |",
        "|---|---|---|---|",
    ]
    for key in (k for k in constructors if k.key.split(".")[0] == group):
        values = set(key.values.values())
        if len(values) == 1 and len(key.values) > 1:
            options = f"all {len(key.values)}: {_code(next(iter(values)))}"
        else:
            options = ", ".join(f"`{option}`: {_code(value)}" for option, value in key.values.items())
        made = _code(key.in_default_run or '""') if key.in_default_run is not None else "—"
        lines.append(f"| `{key.key}` | {_cell(options)} | {_cell(made)} | {_cell(key.doc)} |")
    return lines


def _leading_comment(path: Path) -> str:
    """The comment block at the top of a config file, without Hydra's ``@package`` line."""
    lines = []
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if not stripped.startswith("#"):
            break
        text = stripped.lstrip("#").strip()
        if not text.startswith("@package"):
            lines.append(text)
    return " ".join(lines)


def _group_options(conf: Path) -> list[str]:
    lines = [
        "## Config groups and their options",
        "",
        "Each group is a folder of `conf/` (shipped inside the package); `group=option` on the command line "
        "picks a file. The default run's choices are the `defaults` list of `conf/config.yaml`.",
        "",
    ]
    for group in sorted(p for p in conf.iterdir() if p.is_dir()):
        lines += [f"### `{group.name}=...`", "", "| option | what it is |", "|---|---|"]
        for option in sorted(group.glob("*.yaml")):
            lines.append(f"| `{group.name}={option.stem}` | {_cell(_leading_comment(option)) or '—'} |")
        lines.append("")
        for option in sorted(group.glob("*.yaml")):
            lines += [
                f'??? note "conf/{group.name}/{option.name}"',
                "",
                "    ```yaml",
                *[f"    {line}" for line in option.read_text().rstrip().splitlines()],
                "    ```",
                "",
            ]
    return lines


# ------------------------------------------------------------------------------------------------- metrics


def metrics_page() -> str:
    from stare_lightning.metrics.glossary import PLACEHOLDERS, SECTIONS

    lines = [
        "# Metrics reference",
        "",
        GENERATED_NOTE.format(source="`stare_lightning/metrics/glossary.py`"),
        "",
        "Every column a run logs (`logs/metrics.csv`, TensorBoard) is defined here; the tests fail when a fit "
        "logs a name without an entry. Training metrics start with `train/` and are logged every step, validation "
        "metrics with `val/` and are logged at each validation. A name in angle brackets stands for one path "
        "segment:",
        "",
        "| placeholder | stands for |",
        "|---|---|",
    ]
    meaning = {
        "split": "`train` or `val`",
        "quadrant": "a quadrant of sign(A) x high/low: "
        + ", ".join(f"`{q}`" for q in PLACEHOLDERS["quadrant"].split("|")),
        "kind": "`proxy` (high = selected by STARE) or `exact` (high = Phi > 0)",
        "phase": "a phase of the step: " + ", ".join(f"`{p}`" for p in PLACEHOLDERS["phase"].split("|")),
        "n": "the samples per problem of the benchmark",
        "k": "a k of `validation.pass_k`",
        "benchmark": "a validation benchmark (a record's `metadata.data_source`, else its file's stem or the task)",
        "word": "a reflection word or phrase, spaces as underscores (`let_me_check`)",
    }
    for name in PLACEHOLDERS:
        lines.append(f"| `<{name}>` | {meaning[name]} |")
    for title, entries in SECTIONS:
        lines += ["", f"## {title}", "", "| name | definition |", "|---|---|"]
        lines += [f"| `{name}` | {_cell(text)} |" for name, text in entries.items()]
    lines += ["", "[The telemetry panels](../concepts/telemetry.md) show how these read together."]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------------------------------- CLI


def cli_page() -> str:
    from stare_lightning import cli
    from stare_lightning.data.recipes.command import build_parser, describe_recipes

    os.environ["COLUMNS"] = "100"  # argparse wraps its help to the terminal: a fixed width for the page
    lines = [
        "# Command line",
        "",
        GENERATED_NOTE.format(source="`stare_lightning/cli.py`'s table of subcommands and `prepare`'s parser"),
        "",
        "`python -m stare_lightning` (or the installed `stare-lightning` script) takes a subcommand first:",
        "",
        "```text",
        cli.usage(),
        "```",
        "",
        "| subcommand | what it does | runs |",
        "|---|---|---|",
    ]
    for name, (target, help_line) in cli.SUBCOMMANDS.items():
        kind = "plain arguments" if name in cli.PLAIN_SUBCOMMANDS else "a Hydra config (`key=value` overrides)"
        lines.append(f"| `{name}` | {_cell(help_line)} | `{target}`, {kind} |")
    lines += [
        "",
        "The Hydra subcommands take the same overrides as `fit` (the [configuration reference](configuration.md)); "
        "`-m` turns comma-separated values into a sweep. A mistake in the configuration prints one line naming the "
        "key and exits with status 2.",
        "",
        "## `prepare`",
        "",
        "```text",
        build_parser().format_help().rstrip(),
        "```",
        "",
        "`prepare --list`:",
        "",
        "```text",
        describe_recipes().rstrip(),
        "```",
    ]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------------------------------- API


# What someone extending the project implements or calls: (section, what it is for, the objects, by dotted name).
EXTENSION_POINTS: list[tuple[str, str, list[str]]] = [
    (
        "The LightningModule",
        "The module of `fit`, `validate` and `evaluate`, wiring only (its file stays under 250 lines): "
        "`train.build_module` builds it from a composed config. `configure_model` builds the policy (and the "
        "reference model when a KL term is on), sharded by the strategy; `on_fit_start` builds the `StepRunner` and "
        "the rollout source (collected inside the step, or by the asynchronous producer with "
        "`rollout.max_staleness`); `training_step` takes the step's rollouts, runs `StepRunner.learn` (manual "
        "optimization), checks the log-prob canary, hands the new weights to the engine and logs the step; "
        "`validation_step` samples, verifies and votes on a batch of one benchmark and returns every sample's "
        "record (what `evaluate` writes); `on_save_checkpoint` / `on_load_checkpoint` keep STARE's controller, the "
        "adaptive entropy coefficient and the optimizer-step counters beside Lightning's state.",
        ["stare_lightning.module.STAREModule", "stare_lightning.train.build_module"],
    ),
    (
        "The data module",
        "Streams prompt records (never rollouts: those are made inside the training step). A record is a prompt, "
        "its answer, the verifier that scores it and its metadata; `data.train_files` reads them from JSONL, JSON, "
        "Parquet or `datasets` directories.",
        ["stare_lightning.data.datamodule.PromptDataModule"],
    ),
    (
        "Callbacks",
        "The project's callbacks (`conf/callbacks/`); any Lightning callback can be added the same way, by "
        "`_target_`, once its module is in `allowed_targets`.",
        [
            "stare_lightning.callbacks.entropy_guard.EntropyGuard",
            "stare_lightning.callbacks.sample_dump.RolloutSampleDump",
            "stare_lightning.callbacks.run_summary.RunSummary",
            "stare_lightning.callbacks.progress.StepProgressBar",
            "stare_lightning.callbacks.final_checkpoint.FinalStateCheckpoint",
        ],
    ),
    (
        "Verifiers",
        "A verifier is a function `(response: str, answer: str, metadata: dict) -> float` in [0, 1], named by a "
        "record's `verifier` field: a built-in name or `package.module:function` (listed in `data.user_verifiers`). "
        "Training scores through `VerifierPool`, in a confined worker process with hard timeouts "
        "([verifiers and their isolation](../guides/verifiers.md)).",
        [
            "stare_lightning.rewards.registry.get_verifier",
            "stare_lightning.rewards.registry.known_verifiers",
            "stare_lightning.rewards.registry.check_record",
            "stare_lightning.rewards.pool.VerifierPool",
            "stare_lightning.rewards.message_watch.ScoreResult",
        ],
    ),
    (
        "Tools",
        "What a tool implements (`Tool`) and returns (`ToolResult`); the call formats parse the policy's calls out "
        "of its text ([tool use and the sandbox](../guides/tools.md)).",
        [
            "stare_lightning.tools.base.Tool",
            "stare_lightning.tools.base.ToolResult",
            "stare_lightning.tools.registry.build_tool",
            "stare_lightning.tools.formats.CallFormat",
        ],
    ),
    (
        "Rollout engines",
        "The protocol every rollout backend implements (`rollout.backend`: HF, colocated vLLM, vLLM servers), the "
        "sampling settings it is given and the rollouts it returns.",
        [
            "stare_lightning.rollout.base.RolloutEngine",
            "stare_lightning.rollout.base.SamplingParams",
            "stare_lightning.rollout.base.Rollouts",
            "stare_lightning.rollout.base.EpisodeStats",
        ],
    ),
    (
        "STARE's selectors",
        "What ranks the tokens STARE may reweight (`algorithm.stare.selector`): a function registered in "
        "`STARE_SELECTORS`, one module per selector, reading the `RankingInputs` it declares it needs.",
        [
            "stare_lightning.algorithms.selectors.base.RankingInputs",
            "stare_lightning.algorithms.selectors.base.Selector",
            "stare_lightning.algorithms.selectors.base.required",
            "stare_lightning.algorithms.selectors.surprisal.surprisal",
            "stare_lightning.algorithms.selectors.entropy.predictive_entropy",
            "stare_lightning.algorithms.selectors.sensitivity.sensitivity",
            "stare_lightning.algorithms.selectors.uniform.uniform",
        ],
    ),
    (
        "Policy losses",
        "The per-token surrogate (`algorithm.policy_loss.name`): a function registered in `POLICY_LOSSES` that "
        "takes the token log-probs, the old ones, the advantages, the mask, the clip and STARE's token weights, and "
        "returns the per-token loss and its clip counts.",
        [
            "stare_lightning.algorithms.policy_losses.ClipRange",
            "stare_lightning.algorithms.policy_losses.ppo_surrogate",
            "stare_lightning.algorithms.policy_losses.gspo_surrogate",
            "stare_lightning.algorithms.policy_losses.cispo_surrogate",
        ],
    ),
    (
        "STARE outside this trainer",
        "STARE in a loop of your own (`stare_lightning.integrations.pytorch`) and in TRL's GRPO trainer "
        "(`stare_lightning.integrations.trl`, with the `[trl]` extra): "
        "[STARE in TRL and in your own loop](../guides/trl.md).",
        [
            "stare_lightning.integrations.pytorch.STARE",
            "stare_lightning.integrations.pytorch.STARESettings",
            "stare_lightning.integrations.pytorch.STAREResult",
            "stare_lightning.integrations.trl.STAREGRPOTrainer",
            "stare_lightning.integrations.trl.check_grpo_config",
        ],
    ),
]


def _objects_by_module(dotted: list[str]) -> dict[str, list[str]]:
    by_module: dict[str, list[str]] = defaultdict(list)
    for name in dotted:
        module, _, member = name.rpartition(".")
        by_module[module].append(member)
    return by_module


def _render(module: str, members: list[str], heading_level: int) -> list[str]:
    return [
        "",
        f"::: {module}",
        "    options:",
        "      show_root_heading: false",
        "      show_root_toc_entry: false",
        f"      heading_level: {heading_level}",
        f"      members: [{', '.join(members)}]",
    ]


def api_page() -> str:
    import stare_lightning.algorithms as algorithms

    by_module: dict[str, list[str]] = defaultdict(list)
    for name in algorithms.__all__:
        by_module[getattr(algorithms, name).__module__].append(name)
    lines = [
        "# Python API",
        "",
        GENERATED_NOTE.format(
            source="the extension points listed in `docs/_hooks/reference.py`, "
            "`stare_lightning.algorithms.__all__` and the docstrings"
        ),
        "",
        "First the extension points: what a new verifier, tool, rollout backend, selector, policy loss or callback "
        "implements, and the Lightning classes it plugs into. Then `stare_lightning.algorithms`, the loss's pure "
        "tensor functions.",
        "",
        "## Extension points",
    ]
    for title, intro, dotted in EXTENSION_POINTS:
        lines += ["", f"### {title}", "", intro]
        for module, members in _objects_by_module(dotted).items():
            lines += _render(module, members, heading_level=4)
    lines += [
        "",
        "## `stare_lightning.algorithms`",
        "",
        "The loss's pure tensor functions, importable without Lightning: "
        "`from stare_lightning.algorithms import stare_token_weights`. Each section is the module that defines "
        "the names; the registries that make the loss pluggable follow.",
    ]
    for module in sorted(by_module):
        members = sorted(by_module[module])
        lines += ["", f"### `{module}`", *_render(module, members, heading_level=4)]
    lines += ["", "### Registries", ""]
    registries = {
        "stare_lightning.algorithms.advantages": "ADVANTAGE_ESTIMATORS",
        "stare_lightning.algorithms.policy_losses": "POLICY_LOSSES",
        "stare_lightning.algorithms.entropy_control": "ENTROPY_CONTROLS",
    }
    lines += [
        "A new advantage estimator, policy loss or entropy control is a function registered under a name "
        '(`@REGISTRY.register("name")`) and a YAML file in `conf/algorithm/` that selects it:',
        "",
        "| registry | names |",
        "|---|---|",
    ]
    import importlib

    for module, name in registries.items():
        registry = getattr(importlib.import_module(module), name)
        lines.append(f"| `{module}.{name}` | {', '.join(f'`{n}`' for n in registry.names())} |")
    return "\n".join(lines) + "\n"
