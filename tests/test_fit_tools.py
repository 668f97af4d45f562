"""Training with a tool in the rollout loop: real fits of ``experiment=tool_countdown`` (calculator and the
sandboxed interpreter), their tool telemetry, the rollout dump, and the same run on two ranks."""

from __future__ import annotations

import json

import pytest

from tests.test_episodes import TOOL_RUN, warmed_tool_policy
from tests.test_fit import read_metrics, run_cli, train_rows

# On the worker that runs tests/test_episodes.py: these fits share its tool policy's cold start (another worker would
# wait on the cache's lock, idle, while it is made).
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("tool_policy")]

SHORT = [
    *TOOL_RUN,
    "data.prompts_per_step=4",
    "data.val_batch_size=8",
    "rollout.n=4",
    "rollout.val_n=2",
    "rollout.max_new_tokens=96",
    "rollout.max_turns=2",
    "validation.pass_k=[1,2]",
    "trainer.max_steps=3",
    "trainer.val_check_interval=3",
    "callbacks.sample_dump.every_n_steps=1",
    "summary=false",
]
TOOL_METRICS = [
    "tool/calls_per_episode",
    "tool/used_frac",
    "tool/error_rate",
    "tool/timeout_rate",
    "tool/seconds",
    "episode/turns",
    "episode/ended_by_turns",
    "episode/ended_by_tokens",
]


def _fit(args, model_cache, cwd):
    proc = run_cli(["fit", *args], model_cache, cwd=cwd)
    out, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, out[-4000:]


@pytest.mark.vllm
def test_tool_countdown_fit_with_vllm_logs_tool_telemetry_and_dumps_episodes(tmp_path, model_cache):
    _fit([f"output_dir={tmp_path}", *SHORT, "rollout=vllm"], model_cache, tmp_path)
    rows = read_metrics(tmp_path)
    steps = train_rows(rows)
    assert sorted(steps) == [0, 1, 2]
    for row in steps.values():
        for name in [*TOOL_METRICS, "entropy/after_tool", "entropy/elsewhere", "time/tool"]:
            assert f"train/{name}" in row, name
        assert row["train/tool/calls_per_episode"] > 0
        assert row["train/time/tool"] > 0
        # The engine holds the trainer's weights after every step: the canary over policy tokens stays low.
        assert row["train/rollout/logprob_abs_diff/max"] < 0.05
    validation = [r for r in rows if "val/tool/calls_per_episode" in r]
    assert validation and all(f"val/{name}" in validation[-1] for name in TOOL_METRICS)
    dumped = [json.loads(line) for line in (tmp_path / "rollouts.jsonl").read_text().splitlines()]
    episode = next(e for group in dumped for e in group["episodes"] if e["tool_calls"])
    assert [who for who, _ in episode["segments"]][:3] == ["policy", "tool", "policy"]
    assert "<interpreter>" in episode["segments"][1][1]


@pytest.fixture(scope="module")
def calculator_policy(model_cache, tmp_path_factory):
    """The calculator's tool policy of tests/test_episodes.py (its cold start is cached by then)."""
    return warmed_tool_policy(tmp_path_factory)[0]


@pytest.mark.needs("sandbox")
def test_tool_countdown_fit_with_the_sandboxed_interpreter(tmp_path, model_cache, calculator_policy):
    """Calls run in the bubblewrap sandbox; each step waits for the interpreter's processes and goes on.

    The fit starts from the calculator's policy, a local model directory with no warm-up of its own (the
    interpreter's traces would take one as long as the calculator's). Its calls are bare expressions, which the
    interpreter runs and prints nothing for: this test checks that calls run, not that their replies help."""
    args = [f"output_dir={tmp_path}", *SHORT, "rollout=hf", "trainer.max_steps=2", "validation.before_fit=false"]
    interpreter = ["tools=python", "tools.timeout_seconds=5"]
    start = [f"model.name_or_path={calculator_policy}", "model.cold_start=null"]
    # It rarely answers right, so dynamic sampling would find almost every group's rewards equal and sample a step
    # ten times over.
    _fit([*args, *interpreter, *start, "algorithm.collection.dynamic_sampling=false"], model_cache, tmp_path)
    steps = train_rows(read_metrics(tmp_path))
    assert sorted(steps) == [0, 1]
    for row in steps.values():
        assert row["train/tool/calls_per_episode"] > 0 and row["train/time/tool"] > 0
        assert row["train/tool/error_rate"] < 1  # some calls were well formed, so the sandbox ran them
    episodes = [
        e for line in (tmp_path / "rollouts.jsonl").read_text().splitlines() for e in json.loads(line)["episodes"]
    ]
    ran = [e for e in episodes if e["tool_calls"] and not e["tool_errors"] and not e["malformed_calls"]]
    assert ran and all(e["tool_seconds"] > 0 for e in ran)


def test_tool_episodes_on_two_ranks_match_one_rank(tmp_path, model_cache):
    """The same global batch (4 prompts: 4 on one rank, 2 on each of two): the same episodes and losses."""
    common = [*SHORT, "rollout=hf", "validation.before_fit=false", "trainer.val_check_interval=100",
              "algorithm.stare.target_entropy=10.0", "trainer.precision=32-true"]  # fmt: skip
    one, two = tmp_path / "one", tmp_path / "two"
    _fit([f"output_dir={one}", *common, "trainer=cpu"], model_cache, tmp_path)
    _fit([f"output_dir={two}", *common, "trainer=ddp", "trainer.devices=2", "trainer.accelerator=cpu",
          "data.prompts_per_step=2"], model_cache, tmp_path)  # fmt: skip
    expected, got = train_rows(read_metrics(one)), train_rows(read_metrics(two))
    assert sorted(got) == sorted(expected) == [0, 1, 2]
    for step in expected:
        for name in ["loss", "entropy", "reward/mean", "tool/calls_per_episode", "entropy/after_tool",
                     "response_length/mean", "stare/selected_frac/pos"]:  # fmt: skip
            want, have = expected[step][f"train/{name}"], got[step][f"train/{name}"]
            assert have == pytest.approx(want, abs=1e-5, rel=1e-5, nan_ok=True), f"step {step}: train/{name}"
