"""``python -m stare_lightning fit --help``: the config groups with their options, and the keys people change most,
each with its meaning, its value in the default run and what its check allows.

The meanings and allowed values come from ``config_reference``, the source of the configuration reference page:
the attribute docstrings of the schema and the rules its checks record, and for the trainer's keys the comment on
their line in the default run's option file and the first sentence of Lightning's own documentation of the
argument. Building them validates the default run (which imports the algorithms' registries): a few seconds.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

from stare_lightning import cli
from stare_lightning.config.override_errors import CONSTRUCTOR_GROUPS, config_groups

__all__ = ["COMMON_KEYS", "fit_help"]

# What a newcomer changes first: the run's length and place, the model, the data, the sampling, STARE's knobs and
# the learning rate. Every other key is in the configuration reference.
COMMON_KEYS = (
    "trainer.max_steps",
    "trainer.val_check_interval",
    "seed",
    "output_dir",
    "ckpt_path",
    "verbose",
    "model.name_or_path",
    "model.lora.rank",
    "data.task",
    "data.train_files",
    "data.val_files",
    "data.prompts_per_step",
    "rollout.n",
    "rollout.max_new_tokens",
    "rollout.temperature",
    "algorithm.stare.w",
    "algorithm.stare.target_entropy",
    "algorithm.stare.top_ratio",
    "algorithm.stare.adaptive",
    "algorithm.kl.coef",
    "optim.lr",
    "forward.micro_batch_tokens",
)
# Groups of conf/ that are not fields of the schema: their meaning is written here.
_OTHER_GROUPS = {
    "experiment": "A whole recipe: sets keys of several groups at once (applied after them).",
    "debug": "A few-step smoke run on top of any other choice.",
}
_WIDTH = 100
_LONGEST_RULE = 200  # a longer one (data.task's reasoning-gym names) is cut: the reference has it whole


def _wrapped(text: str, indent: int) -> list[str]:
    return textwrap.wrap(text, _WIDTH, initial_indent=" " * indent, subsequent_indent=" " * indent)


def _group_lines(conf: Path, chosen: dict[str, list[str]], docs: dict[str, str]) -> list[str]:
    lines = ["Config groups: GROUP=OPTION picks the file conf/GROUP/OPTION.yaml (* marks the default run's):"]
    for group in config_groups(conf):
        options = sorted(path.stem for path in (conf / group).glob("*.yaml"))
        marked = "  ".join(f"{o}*" if o in chosen.get(group, ()) else o for o in options)
        lines += textwrap.wrap(marked, _WIDTH, initial_indent=f"  {group:<11} ", subsequent_indent=" " * 14)
        lines += _wrapped(docs.get(group) or _OTHER_GROUPS.get(group, ""), 14)
    lines.append("  (logger takes a list: logger=[csv,wandb])")
    return lines


def _chosen_options(with_hydra) -> dict[str, list[str]]:
    """The default run's option of each group (a list for a group that takes several, like logger)."""
    choices = {str(k): [str(v)] for k, v in with_hydra.hydra.runtime.choices.items() if v is not None}
    choices["logger"] = [str(name) for name in (with_hydra.get("logger") or {})]
    return choices


def _trainer_rows(keys: list[str], default_run) -> dict[str, tuple[str, str]]:
    """``key -> (meaning, the default run's value)`` for keys of the trainer's option file."""
    import lightning

    from stare_lightning.config_reference import argument_docs, show, yaml_comments

    option = cli.compose([], with_hydra=True).hydra.runtime.choices["trainer"]
    comments = yaml_comments(Path(cli.config_dir()) / "trainer" / f"{option}.yaml", "trainer")
    lightning_docs = argument_docs(lightning.Trainer)
    rows = {}
    for key in keys:
        name = key.split(".", 1)[1]
        here = comments.get(key, "")
        lightning_says = lightning_docs.get(name, "").split(". ")[0].rstrip(".")
        meaning = f"{here[:1].upper()}{here[1:]}. " if here else ""
        rows[key] = (f"{meaning}Lightning: {lightning_says}.", show(default_run.trainer.get(name)))
    return rows


def _key_lines() -> tuple[list[str], dict[str, str]]:
    """The common keys' lines, and the meanings of the schema's top-level fields (the groups')."""
    from stare_lightning.config_reference import attribute_docs, config_keys
    from stare_lightning.run_config import RunConfig

    schema = {item.key: item for item in config_keys()}
    default_run = cli.compose([])
    constructor = [key for key in COMMON_KEYS if key.split(".")[0] in CONSTRUCTOR_GROUPS]
    trainer = _trainer_rows(constructor, default_run)
    lines = ["Keys people change most: KEY=VALUE (type; the default run's value; what the check allows):"]
    for key in COMMON_KEYS:
        if key in trainer:
            meaning, value = trainer[key]
            facts = f"the default run: {value}; an argument of Lightning's Trainer"
        else:
            item = schema[key]
            meaning, value = item.doc, item.in_default_run
            allowed = item.allowed if len(item.allowed) <= _LONGEST_RULE else item.allowed[:_LONGEST_RULE] + "..."
            facts = "; ".join(part for part in (item.type, f"the default run: {value}", allowed) if part)
        lines += [f"  {key}  ({facts})", *_wrapped(meaning, 6)]
    return lines, attribute_docs(RunConfig)


def fit_help(subcommand: str = "fit") -> str:
    """The help text of a Hydra subcommand (they all take the same config)."""
    conf = Path(cli.config_dir())
    key_lines, group_docs = _key_lines()
    with_hydra = cli.compose([], with_hydra=True)
    lines = [
        f"usage: python -m stare_lightning {subcommand} [GROUP=OPTION ...] [KEY=VALUE ...]",
        f"       python -m stare_lightning {subcommand} -m KEY=A,B ...   (a sweep: one run per value)",
        "",
        cli.SUBCOMMANDS[subcommand][1],
        "",
        *_group_lines(conf, _chosen_options(with_hydra), group_docs),
        "",
        *key_lines,
        "",
        "Every key, with its meaning and allowed values: the configuration reference, reference/configuration.md of",
        "the documentation (`make docs` builds it into site/), or `python -m stare_lightning.config_reference` here.",
        "A mistyped key or value is refused before anything loads, naming what was meant or the type needed.",
        "Add --cfg job to print the configuration a command line composes (nothing runs); --hydra-help: Hydra's own.",
    ]
    return "\n".join(lines)
