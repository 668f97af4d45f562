"""A misspelled key, group or wrongly typed value is refused before Hydra starts, in one line that names what was
meant or the type needed, and never with Hydra's advice to add the key with ``+``.

The four cases a newcomer meets first run through the command line itself (``python -m stare_lightning fit``, in
parallel); the other wordings are checked on the function the command line calls before Hydra starts."""

from __future__ import annotations

import os

import pytest

from stare_lightning import cli
from stare_lightning.config.override_errors import config_groups
from tests import forked_cli

COMMAND_LINE_CASES = {
    "algorithm.stare.ww=2": "algorithm.stare.ww is not a key of algorithm.stare (override 'algorithm.stare.ww=2'): "
    "did you mean algorithm.stare.w?",
    "algoritm=grpo_ds": "algoritm is neither a config group nor a key (override 'algoritm=grpo_ds'): did you mean "
    "algorithm? the groups (group=option) are algorithm, callbacks, data, debug, experiment, logger, model, rollout, "
    "tools, trainer; the other top-level keys are seed, output_dir",
    "trainer.max_step=2": "trainer.max_step is not a key of trainer (override 'trainer.max_step=2'): did you mean "
    "trainer.max_steps?",
    "algorithm.stare.w=abc": "algorithm.stare.w takes a float, not 'abc' (override 'algorithm.stare.w=abc')",
}


def test_the_first_mistakes_get_one_line_naming_what_was_meant(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "STARE_LIGHTNING_CACHE": str(tmp_path / "cache")}
    env.pop("HYDRA_FULL_ERROR", None)
    runs = {
        override: forked_cli.ForkedCommand(["fit", override, *extra], cwd=tmp_path, env=env, separate_stderr=True)
        for override, extra in [
            *((case, []) for case in COMMAND_LINE_CASES),
            ("algorithm.stare.w=2.5", ["--cfg", "job"]),
        ]
    }
    control = runs.pop("algorithm.stare.w=2.5")
    for override, proc in runs.items():
        stdout, stderr = proc.communicate(timeout=120)
        lines = [line for line in stderr.splitlines() if line.strip()]
        assert proc.returncode == 2, (override, stderr[-2000:])
        assert len(lines) == 1 and lines[0].startswith("error: " + COMMAND_LINE_CASES[override]), (override, lines)
        assert "+" not in lines[0] and "To append" not in stdout + stderr, (override, lines[0])
    stdout, stderr = control.communicate(timeout=120)  # the accepted spelling composes (--cfg job trains nothing)
    assert control.returncode == 0 and "    w: 2.5\n" in stdout, stderr[-2000:]
    assert not any(tmp_path.rglob("*.log")), "a refused command started a run"


def refused(overrides: list[str]) -> str:
    with pytest.raises(ValueError) as caught:
        cli.check_what_hydra_will_build(overrides)
    return str(caught.value)


def test_each_mistake_is_told_in_the_projects_words_and_the_accepted_spelling_passes():
    assert refused(["+algorithm.stare.ww=2"]).startswith(
        "algorithm.stare.ww is not a key of algorithm.stare (override '+algorithm.stare.ww=2'): did you mean "
        "algorithm.stare.w?"
    )  # composition lets a `+` key through; the schema would refuse it in the job, so it is refused here
    no_match = refused(["algorithm.stare.zzzzzz=1"])
    assert no_match.startswith("algorithm.stare.zzzzzz is not a key of algorithm.stare")
    assert "its keys are enabled, variant, top_ratio, w, m, target_entropy," in no_match and "+" not in no_match
    assert refused(["sed=3"]).startswith(
        "sed is neither a config group nor a key (override 'sed=3'): did you mean seed?"
    )
    assert refused(["+algoritm=grpo_ds"]).startswith(
        "algoritm is neither a config group nor a key (override '+algoritm"
    )
    assert refused(["data.val_sets=[{name: a, nn: 1}]"]) == (
        "nn is not a key of a ValSetConfig entry (override 'data.val_sets=[{name: a, nn: 1}]'): did you mean n?"
    )  # OmegaConf names a list entry's key alone: the entry's type and the override that holds it say where
    assert refused(["seed=abc"]) == "seed takes an integer, not 'abc' (override 'seed=abc')"
    assert (
        refused(["model.lora.rank=1.5"]) == "model.lora.rank takes an integer, not 1.5 (override 'model.lora.rank=1.5')"
    )
    assert refused(["rollout.server.urls=3"]).startswith("rollout.server.urls takes a list")
    assert refused(["summary=maybe"]).startswith("summary takes a boolean (true or false), not 'maybe'")
    assert refused(["rollout.max_turns=x"]).startswith("rollout.max_turns takes an integer or null, not 'x'")
    # The keys a group has depend on its option: trainer=fsdp's strategy has keys trainer=cpu's does not.
    assert "did you mean trainer.strategy.cpu_offload?" in refused(["trainer=fsdp", "trainer.strategy.cpu_ofload=true"])
    # A constructor group may take an argument its option file leaves unset: only there is `+` worth saying.
    assert refused(["trainer.foo=1"]).endswith("add it: +trainer.foo=1")
    for accepted in (
        ["algorithm.stare.w=2"],
        ["algorithm=grpo_ds"],
        ["trainer.max_steps=2"],
        ["+trainer.detect_anomaly=true"],
        ["trainer=fsdp", "trainer.strategy.cpu_offload=true"],
        ["rollout.max_turns=null"],
        ["data.val_sets=[{name: a, n: 1}]"],
        ["+data.task_kwargs.size=3", "+rollout.engine_kwargs.max_num_seqs=4"],  # free mappings take new keys
    ):
        cli.check_what_hydra_will_build(accepted)


def test_the_groups_named_are_the_folders_of_conf():
    expected = ["algorithm", "callbacks", "data", "debug", "experiment", "logger", "model", "rollout", "tools"]
    assert config_groups(cli.config_dir()) == [*expected, "trainer"]
