"""The documentation: the site builds strictly, its generated Reference covers the code, the README's links hold.

The configuration reference is generated from the schema dataclasses' attribute docstrings and from what their
checks note (``config_reference.py``), the metrics reference from ``metrics/glossary.py``; these tests fail when a
field has no description, a check names a key the schema lacks, or a logged metric has no glossary entry (the
end-to-end fit in ``test_fit.py`` checks the names a real run logs).
"""

from __future__ import annotations

import csv
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from stare_lightning.config_reference import CONSTRUCTOR_GROUPS, config_keys, constructor_keys
from stare_lightning.metrics.glossary import ENTRIES, entry_for, undocumented

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def keys():
    return config_keys()


def test_site_builds_strictly_with_every_reference_page(tmp_path, keys):
    site = tmp_path / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "PYTHONDONTWRITEBYTECODE": "1"}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "mkdocs",
            "build",
            "--strict",
            "--config-file",
            str(REPO / "mkdocs.yml"),
            "--site-dir",
            str(site),
        ],  # fmt: skip
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert not [line for line in done.stderr.splitlines() if line.startswith("WARNING")]
    configuration = (site / "reference" / "configuration" / "index.html").read_text()
    for key in [*keys, *constructor_keys()]:
        assert f"<code>{key.key}</code>" in configuration, key.key
    metrics = (site / "reference" / "metrics" / "index.html").read_text()
    for name in ENTRIES:
        assert name.replace("<", "&lt;").replace(">", "&gt;") in metrics, name
    assert "def " not in (site / "reference" / "cli" / "index.html").read_text()  # help text, not source
    api = (site / "reference" / "api" / "index.html").read_text()
    import stare_lightning.algorithms as algorithms

    for name in algorithms.__all__:
        assert re.search(rf'id="stare_lightning\.algorithms\.[a-z_]+\.{name}"', api), name
    # The extension points, each object with its own entry; docstring lists are lists, not one paragraph.
    for _, _, dotted in _hook("reference").EXTENSION_POINTS:
        for name in dotted:
            assert f'id="{name}"' in api, name
    assert "<p>What it implements:</p>" in api and "What it implements:\n- " not in api
    # Formulas are MathML written at build time; no page loads a script, style sheet, font or image from another host.
    for page in ("method", "concepts/gate-and-quadrants"):
        built = (site / page / "index.html").read_text()
        assert built.count("<math ") > 10 and "arithmatex" not in built and "\\(" not in built, page
    remote = re.compile(r'<(?:script|link|img|source|iframe)\b[^>]*\b(?:src|href)="(?:https?:)?//', re.IGNORECASE)
    outside = [str(path.relative_to(site)) for path in site.rglob("*.html") if remote.search(path.read_text())]
    assert not outside, f"pages that load something from another host: {outside}"
    # The summary example is the real table of a committed run, at 80 columns.
    started = (site / "getting-started" / "index.html").read_text()
    assert "train/quadrant/exact/pos_high/tokens" in started and "summary-example" not in started
    # The three things to try stay three list items around the indented code block of the first.
    assert started.split('id="the-next-three-things-to-try"')[1].split("</ol>")[0].count("<li>") == 3


def test_every_schema_field_has_a_description(keys):
    missing = [k.key for k in keys if not k.doc]
    assert not missing, (
        f"{len(missing)} config keys have no description (an attribute docstring under the field): {missing}"
    )
    assert len([k for k in keys if not k.group]) > 140  # every group's keys were reached


def test_the_trainer_callbacks_and_logger_keys_are_listed_with_a_meaning():
    """Every key an option file of a constructor group sets, each with a meaning (the class's ``Args:`` entry or the
    file's comment), and every option of every group with a description (its file's leading comment)."""
    from stare_lightning.cli import config_dir

    constructors = {k.key: k for k in constructor_keys()}
    assert len(constructors) > 40 and {k.split(".")[0] for k in constructors} == set(CONSTRUCTOR_GROUPS)
    missing = sorted(key for key, item in constructors.items() if not item.doc)
    assert not missing, (
        f"constructor keys with no meaning (document the class's argument, or comment the line): {missing}"
    )
    max_steps = constructors["trainer.max_steps"]
    assert max_steps.in_default_run == "300" and "optimizer steps" in max_steps.doc
    assert (
        constructors["trainer.accelerator"].values["gpu"] == "gpu"
        and "accelerator" in constructors["trainer.accelerator"].doc
    )
    assert "Supports different training strategies" in constructors["trainer.strategy"].doc  # Lightning's own words
    assert "outside the band" in constructors["callbacks.entropy_guard.patience"].doc  # this project's docstring
    assert constructors["trainer.strategy.param_dtype"].values == {"fsdp": "bfloat16", "fsdp_fp16": "float16"}
    conf = Path(config_dir())
    undescribed = [
        f"{path.parent.name}={path.stem}"
        for path in sorted(conf.glob("*/*.yaml"))
        if not path.read_text().lstrip().startswith("#")
    ]
    assert not undescribed, f"options with no leading comment (the reference's description): {undescribed}"


def test_the_argument_docs_parser_reads_google_style_sections_through_the_class_hierarchy():
    from stare_lightning.config_reference import argument_docs

    class Base:
        """A base.

        Args:
            alpha: the first
                argument, continued.

            beta (int): the second, with a ``literal`` and :class:`~pkg.mod.Thing`.
                Second paragraph? No: same entry, one paragraph.

                A new paragraph is left out.
            **kwargs: the rest.

        Returns:
            nothing.
        """

    class Child(Base):
        def __init__(self, gamma=1):
            """A child.

            Args:
                gamma: the child's own.
            """

    docs = argument_docs(Child)
    assert docs == {
        "gamma": "the child's own.",
        "alpha": "the first argument, continued.",
        "beta": "the second, with a `literal` and `Thing`. Second paragraph? No: same entry, one paragraph.",
        "kwargs": "the rest.",
    }


def test_allowed_values_are_the_schemas_own_checks(keys):
    from stare_lightning.algorithms.stare import STARE_SCOPES
    from stare_lightning.config_reference import checked_rules
    from stare_lightning.tools.config import ISOLATIONS

    by_key = {k.key: k for k in keys}
    unknown = sorted(set(checked_rules()) - set(by_key))
    assert not unknown, f"checks name keys the schema does not have: {unknown}"
    assert by_key["algorithm.stare.scope"].allowed == "one of [" + ", ".join(repr(s) for s in STARE_SCOPES) + "]"
    assert by_key["tools.isolation"].allowed == "one of [" + ", ".join(repr(s) for s in ISOLATIONS) + "]"
    assert by_key["algorithm.policy_loss.dual_clip_c"].allowed == "a number > 1.0"  # checked only when set: probed
    assert by_key["validation.pass_k"].allowed == "each: an integer >= 1"
    assert by_key["data.val_sets[].top_p"].allowed == "a number in (0.0, 1.0]"
    # data.task: every value it accepts, whichever data.source picks it.
    from stare_lightning.data.tasks import task_names
    from stare_lightning.data.tasks.reasoning_gym import generator_names

    task = by_key["data.task"].allowed
    assert all(repr(name) in task for name in [*task_names(), *generator_names(), "mixture"]) and "null" in task
    # The default run's value beside the schema's default.
    assert (by_key["algorithm.stare.w"].default, by_key["algorithm.stare.w"].in_default_run) == ("1.1", "3.0")


def test_the_committed_runs_log_only_documented_metrics():
    names = set()
    for metrics in sorted((REPO / "notebooks" / "data").rglob("metrics.csv")):
        with open(metrics) as handle:
            names |= set(next(csv.reader(handle)))
    assert len(names) > 60
    assert not undocumented(names), f"no entry in stare_lightning/metrics/glossary.py: {undocumented(names)}"


@pytest.mark.parametrize(
    ("name", "entry"),
    [
        ("train/reflection/let_me_check", "<split>/reflection/<word>"),
        ("val/reflection/per_response", "<split>/reflection/per_response"),
        ("val/aime24/avg@32", "val/<benchmark>/avg@<n>"),
        ("val/pass@16", "val/pass@<k>"),
        ("val/response_length/truncated_frac", "<split>/response_length/truncated_frac"),
        ("train/quadrant/proxy/neg_low/weight", "train/quadrant/<kind>/<quadrant>/weight"),
        ("train/time/verify", "train/time/<phase>"),
        ("train/quadrant/exact/pos_middle/dH", None),  # not a quadrant
        ("train/time/nap", None),  # not a phase
        ("val/pass@k", None),
        ("train/entropy/made_up", None),
    ],
)
def test_glossary_patterns_match_what_they_name_and_nothing_else(name, entry):
    assert entry_for(name) == entry


def test_readme_is_short_and_its_links_and_figure_exist():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 150
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", readme)
    local = [t for t in targets if not t.startswith(("http://", "https://"))]
    assert "docs/assets/figures/entropy_grpo_vs_stare.png" in local
    missing = [t for t in local if not (REPO / t).is_file()]
    assert not missing, f"README links to files that do not exist: {missing}"


def test_the_layout_page_names_every_module_of_the_packages_it_lists_file_by_file():
    """docs/concepts/layout.md lists the top-level modules and the files of step/, rollout/ and rollout/server/ one
    by one: a module added there without a line on that page fails here."""
    layout = (REPO / "docs" / "concepts" / "layout.md").read_text()
    package = REPO / "stare_lightning"
    listed = [*package.glob("*.py"), *(package / "step").glob("*.py"), *(package / "rollout").rglob("*.py")]
    missing = sorted(
        str(path.relative_to(package)) for path in listed if path.name != "__init__.py" and path.name not in layout
    )
    assert not missing, f"modules docs/concepts/layout.md does not name: {missing}"


STUDIES = {"async.md": "async_study", "offline.md": "offline_tradeoff", "tool-use.md": "tool_countdown"}
STUDIES["smollm2.md"] = "smollm2_study"
STUDIES["lora.md"] = "lora_study"
ENTROPY_TAIL = 10  # the SmolLM2 and LoRA studies' entropy window: steps 90-99 of 100
UNCORRECTED, OFFLINE_GRPO = "stare_o1_k4_uncorrected", "default/grpo_ds"


@pytest.mark.parametrize(
    ("page", "arm", "baseline", "outcome", "val_tail", "quoted"),
    [
        ("async.md", "stare_o1_k4", "stare_o1_k0", "val_avg@n", 3, "-0.069 [-0.137, -0.001]"),
        ("async.md", "stare_o1_k4", "stare_o1_k0", "val_avg@n", 1, "-0.052 [-0.126, +0.022]"),
        ("async.md", "grpo_ds_k4", "grpo_ds_k0", "val_avg@n", 1, "-0.126 [-0.295, +0.042]"),
        ("async.md", "grpo_ds_k4", "grpo_ds_k0", "val_pass@4", 1, "-0.172 [-0.211, -0.133]"),
        ("async.md", UNCORRECTED, "stare_o1_k4", "val_avg@n", 1, "-0.049 [-0.086, -0.013]"),
        ("async.md", UNCORRECTED, "stare_o1_k4", "val_pass@4", 1, "-0.109 [-0.148, -0.071]"),
        ("offline.md", "stare_c2", OFFLINE_GRPO, "val_pass@4", 1, "+0.229 [+0.054, +0.404]"),
        ("offline.md", "stare_o1_w2/stare_o1", OFFLINE_GRPO, "val_pass@4", 1, "+0.167 [+0.048, +0.285]"),
        ("offline.md", "stare_o1_adaptive", OFFLINE_GRPO, "val_pass@4", 1, "+0.177 [+0.015, +0.339]"),
        ("offline.md", "default/stare_o1", OFFLINE_GRPO, "val_pass@4", 1, "+0.182 [-0.070, +0.435]"),
        ("tool-use.md", "stare_o1", "grpo_ds", "val_avg@n", 3, "-0.034 [-0.050, -0.017]"),
        ("tool-use.md", "stare_o1", "grpo_ds", "val_avg@n", 1, "+0.021 [-0.400, +0.443]"),
        ("smollm2.md", "stare_o1", "grpo_ds", "val_avg@n", 1, "-0.008 [-0.033, +0.016]"),
        ("smollm2.md", "stare_c2", "grpo_ds", "val_avg@n", 1, "-0.009 [-0.037, +0.018]"),
        ("smollm2.md", "stare_o1_adaptive", "grpo_ds", "val_avg@n", 1, "-0.008 [-0.038, +0.022]"),
        ("smollm2.md", "stare_o1", "grpo_ds", "entropy", 3, "+0.090 [+0.063, +0.117]"),
        ("lora.md", "stare_o1_lora", "grpo_ds_lora", "entropy", 3, "+0.166 [+0.060, +0.272]"),
        ("lora.md", "stare_o1_lora", "grpo_ds_lora", "val_avg@n", 3, "-0.015 [-0.028, -0.001]"),
    ],
)
def test_the_results_pages_quote_both_evaluation_windows_from_the_committed_summaries(
    page, arm, baseline, outcome, val_tail, quoted
):
    """A paired difference a results page quotes under a given validation window (``val_tail``: the last three
    validations, or the final one alone; the entropy over ``ENTROPY_TAIL`` steps), computed again from the summaries
    committed under notebooks/data."""
    from stare_lightning.analysis.compare import find_runs, seed_statistics

    runs = [run for run in find_runs(REPO / "notebooks" / "data" / STUDIES[page]) if run.arm in (arm, baseline)]
    stats = seed_statistics(runs, baseline=baseline, tail=ENTROPY_TAIL, val_tail=val_tail)
    stats = stats.set_index(["arm", "outcome"])
    row = stats.loc[(arm, outcome)]
    assert f"{row['diff']:+.3f} [{row['diff_lo']:+.3f}, {row['diff_hi']:+.3f}]" == quoted
    assert quoted in " ".join((REPO / "docs" / "results" / page).read_text().split()), f"{page} does not quote {quoted}"


BOTH = ("README.md", "docs/results/offline.md")


@pytest.mark.parametrize(
    ("arm", "baseline", "outcome", "val_tail", "quoted", "pages"),
    [
        ("stare_o1", "grpo_ds", "entropy", 3, "+0.123 [+0.112, +0.134]", BOTH),
        ("stare_o1", "grpo_ds", "val_avg@n", 3, "-0.034 [-0.060, -0.008]", BOTH),
        ("stare_o1", "grpo_ds", "val_pass@4", 3, "+0.042 [+0.001, +0.083]", BOTH),
        ("stare_o1_w2", "grpo_ds", "entropy", 3, "+0.100 [+0.092, +0.109]", BOTH),
        ("stare_o1_w2", "grpo_ds", "val_avg@n", 3, "-0.021 [-0.056, +0.013]", BOTH),
        ("stare_o1_w2", "grpo_ds", "val_pass@4", 3, "+0.060 [+0.026, +0.094]", BOTH),
        ("stare_o1", "grpo_ds", "distinct_correct", 3, "+0.311 [+0.273, +0.348]", BOTH[1:]),
        ("stare_o1_w2", "stare_o1", "entropy", 3, "-0.023 [-0.029, -0.016]", BOTH[1:]),
        ("stare_o1_w2", "stare_o1", "val_avg@n", 3, "+0.013 [-0.013, +0.040]", BOTH),
        ("stare_o1_w2", "stare_o1", "val_pass@4", 3, "+0.018 [-0.021, +0.056]", BOTH),
        ("stare_o1", "grpo_ds", "val_pass@4", 1, "+0.027 [-0.047, +0.101]", BOTH[1:]),
        ("stare_o1", "grpo_ds", "val_avg@n", 1, "-0.050 [-0.094, -0.006]", BOTH[1:]),
    ],
)
def test_the_ten_seed_headline_is_quoted_from_its_committed_summaries(arm, baseline, outcome, val_tail, quoted, pages):
    """The README's and the offline page's ten-seed figures (scripts/offline_headline.sh; the window it fixed is the
    last three validations, and the final one alone is quoted beside it), computed again from
    notebooks/data/offline_headline."""
    from stare_lightning.analysis.compare import find_runs, seed_statistics

    runs = [run for run in find_runs(REPO / "notebooks" / "data" / "offline_headline") if run.arm in (arm, baseline)]
    stats = seed_statistics(runs, baseline=baseline, val_tail=val_tail).set_index(["arm", "outcome"])
    row = stats.loc[(arm, outcome)]
    assert row["pairs"] == 10
    assert f"{row['diff']:+.3f} [{row['diff_lo']:+.3f}, {row['diff_hi']:+.3f}]" == quoted
    for page in pages:
        assert quoted in " ".join((REPO / page).read_text().split()), f"{page} does not quote {quoted}"


def _hook(name: str):
    """A module of docs/_hooks/, loaded from its file."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"{name}_hook", REPO / "docs" / "_hooks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_lists_written_right_under_a_line_of_text_become_lists():
    hook = _hook("lists")
    text = [
        "What it implements:",
        "- GRPO: one",
        "  continued.",
        "- Dr.GRPO: two",
        "",
        "Steps:",
        "1. first",
        "2. second",
        "A sentence that wraps before",
        "2026. is not a list item",
        "```text",
        "a line",
        "- not touched inside a fence",
        "```",
        "| table | row |",
        "- after a table row: untouched",
    ]
    assert hook.blank_lines_before_lists(text) == [
        "What it implements:",
        "",
        *text[1:6],
        "",
        *text[6:],
    ]


def test_the_maths_hook_writes_mathml_and_refuses_what_it_cannot_convert():
    hook = _hook("maths")
    page = (
        '<p>so <span class="arithmatex">\\(\\Phi &lt; 0\\)</span> here</p>'
        '<div class="arithmatex">\\[\\Delta H \\approx \\eta A \\Phi\\]</div><code>\\(kept\\)</code>'
    )
    out = hook.render(page, where="page.md")
    assert out.count("<math ") == 2 and 'display="inline"' in out and 'display="block"' in out
    assert "&#x0003C;" in out and "arithmatex" not in out and "<code>\\(kept\\)</code>" in out
    with pytest.raises(ValueError, match="page.md"):
        hook.render('<span class="arithmatex">\\(\\nocommand{x}\\)</span>', where="page.md")
