"""End-to-end runs of the training system on the built-in tiny model (real Trainer, real rollouts)."""

from __future__ import annotations

import csv
import dataclasses
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from stare_lightning.cli import compose, prepare_config
from stare_lightning.metrics import QUADRANTS as QUADRANT_NAMES
from stare_lightning.metrics.glossary import undocumented
from stare_lightning.metrics.step_timer import PHASES
from tests.forked_cli import ForkedCommand, forking

pytestmark = pytest.mark.slow

# Short runs that still learn: a cold start long enough that some groups have mixed rewards.
FAST = ["debug=fast", "rollout=hf", "model.cold_start.steps=150", "data.prompts_per_step=8", "rollout.n=6"]
REPO = Path(__file__).resolve().parents[1]


def compose_run(output_dir, overrides=()):
    return prepare_config(compose([f"output_dir={output_dir}", *FAST, *overrides]))[1]


def read_metrics(run_dir: Path) -> list[dict[str, float]]:
    with open(run_dir / "logs" / "metrics.csv") as handle:
        return [{k: float(v) for k, v in row.items() if v != ""} for row in csv.DictReader(handle)]


def wait_for_checkpoint(proc, checkpoint: Path, timeout: float = 600) -> None:
    """Wait until ``checkpoint`` is written whole while ``proc`` still runs (so that it can be killed mid-run)."""
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        if checkpoint.is_file():
            try:
                torch.load(checkpoint, map_location="cpu", weights_only=False)
                break
            except Exception:  # still being written
                pass
        time.sleep(0.1)
    assert proc.poll() is None, "the run ended before it could be killed"


def train_rows(rows):
    return {int(r["step"]): r for r in rows if "train/entropy" in r}


def run_cli(args, env_cache, *, cwd, entry=("-m", "stare_lightning"), fresh=False, **kwargs):
    """The command line in a process of its own, started in ``cwd`` (a test's tmp_path): what Hydra writes relative
    to it (outputs/ of a run without hydra.run.dir, the DDP children's re-entries) stays out of the checkout.
    Forked from a process that has imported the stack (``tests/forked_cli.py``) unless ``fresh``, another ``entry``
    or a Popen option other than ``start_new_session`` asks for a fresh interpreter."""
    env = {**os.environ, "STARE_LIGHTNING_CACHE": env_cache, "PYTHONUNBUFFERED": "1"}
    if not fresh and entry == ("-m", "stare_lightning") and set(kwargs) <= {"start_new_session"} and forking(args):
        return ForkedCommand(list(args), env=env, cwd=cwd, new_session=kwargs.get("start_new_session", False))
    return subprocess.Popen(
        [sys.executable, *entry, *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        **kwargs,
    )


DESIGN_NAMES = [
    "reward/mean",
    "reward/std",
    "frac_zero_std_groups",
    "entropy",
    "response_length/mean",
    "response_length/max",
    "clip_ratio/low",
    "clip_ratio/high",
    "kl",
    "grad_norm",
    "stare/gate_on",
    "stare/w",
    "stare/m",
    "stare/selected_frac/pos",
    "stare/selected_frac/neg",
    "entropy/predicted_delta",
    "entropy/realized_delta",
    "reflection/per_response",
    "rollout/logprob_abs_diff/mean",
    "rollout/logprob_abs_diff/max",
    "rollout/tokens_per_s",
    "distinct_correct",
] + [
    f"quadrant/{kind}/{q}/{field}"
    for kind in ("proxy", "exact")
    for q in ("pos_high", "pos_low", "neg_high", "neg_low")
    for field in ("tokens", "weight", "dH")
]


def test_few_step_fit_changes_every_parameter_and_logs_every_metric(tmp_path, model_cache):
    from stare_lightning import train

    cfg = compose_run(
        tmp_path, ["trainer.max_steps=3", "algorithm.stare.target_entropy=10.0", "telemetry.same_batch_entropy=true"]
    )
    module, datamodule = train._setup(cfg)
    trainer = train.build_trainer(cfg)
    module.configure_model()
    before = {name: p.detach().clone() for name, p in module.policy.named_parameters() if p.requires_grad}
    trainer.fit(module, datamodule=datamodule)
    after = dict(module.policy.named_parameters())
    unchanged = [name for name, value in before.items() if torch.equal(value, after[name].detach())]
    assert not unchanged, f"parameters that did not move: {unchanged}"

    rows = read_metrics(tmp_path)
    logged = set().union(*rows)
    missing = [name for name in DESIGN_NAMES if f"train/{name}" not in logged]
    assert not missing, f"metric names missing from the CSV log: {missing}"
    # Every name a real fit logs is defined in the metrics reference (stare_lightning/metrics/glossary.py).
    assert not undocumented(logged), f"logged metric names without a glossary entry: {undocumented(logged)}"
    for name in ("avg@n", "pass@1", "distinct_correct", "reflection/per_response"):
        assert f"val/{name}" in logged
    steps = train_rows(rows)
    assert sorted(steps) == [0, 1, 2]
    assert all(steps[s]["train/stare/gate_on"] == 1.0 for s in steps)  # target 10 nats: the gate is always on
    for row in steps.values():  # the update's entropy change on its own batch, and its first-order split
        realised, first = row["train/entropy/realized_delta_same_batch"], row["train/entropy/first_order_delta"]
        assert math.isfinite(realised) and realised != 0.0 and math.isfinite(first)
        assert math.isfinite(sum(row[f"train/quadrant/first_order/{q}"] for q in QUADRANT_NAMES))
        # The time breakdown accounts for the whole step; every phase ran.
        phases = [row[f"train/time/{phase}"] for phase in PHASES]
        assert sum(phases) == pytest.approx(row["train/time/step_s"], rel=1e-6)  # logged as float32
        assert all(t > 0 for p, t in zip(PHASES, phases) if p != "tool"), dict(zip(PHASES, phases))
        assert row["train/time/tool"] == 0.0  # no tool in this run
        assert row["train/throughput/tokens_per_s"] > 0
    assert (tmp_path / "checkpoints" / "last.ckpt").is_file()


def test_killed_run_resumes_exactly(tmp_path, model_cache):
    # The adaptive schedule with the gate always open moves W every step: the controller's state must resume.
    adaptive = [
        "algorithm.stare.adaptive=true",
        "algorithm.stare.w=1.1",
        "algorithm.stare.target_entropy=10.0",
        "algorithm.stare.alpha=0.1",
    ]
    common = (
        FAST
        + adaptive
        + [
            "trainer.max_steps=4",
            "callbacks.model_checkpoint.every_n_train_steps=2",
            "trainer.val_check_interval=100",
            "validation.before_fit=false",
        ]
    )
    straight = tmp_path / "straight"
    proc = run_cli(["fit", f"output_dir={straight}", *common], model_cache, cwd=tmp_path)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-3000:]

    killed = tmp_path / "killed"
    proc = run_cli(["fit", f"output_dir={killed}", *common], model_cache, cwd=tmp_path, start_new_session=True)
    checkpoint = killed / "checkpoints" / "epoch=0-step=2.ckpt"
    wait_for_checkpoint(proc, checkpoint)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()

    resumed = run_cli(
        ["fit", f"output_dir={killed}", f"ckpt_path='{checkpoint}'", *common], model_cache, cwd=tmp_path
    )  # quoted: the name holds '='
    out, _ = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, out[-3000:]
    expected, got = train_rows(read_metrics(straight)), train_rows(read_metrics(killed))
    for step in (2, 3):
        timing = ("tokens_per_s", "train/time/", "train/memory/")
        keys = [k for k in expected[step] if k.startswith("train/") and not any(t in k for t in timing)]
        assert len(keys) > 40
        for key in keys:
            a, b = expected[step][key], got[step][key]
            assert (math.isnan(a) and math.isnan(b)) or a == b, f"step {step} {key}: {a} != {b}"
    assert [round(expected[step]["train/stare/w"], 6) for step in range(4)] == [1.1, 1.2, 1.3, 1.4]

    # `validate` evaluates the finished checkpoint.
    evaluated = tmp_path / "validate"
    proc = run_cli(
        ["validate", f"output_dir={evaluated}", f"ckpt_path={straight / 'checkpoints' / 'last.ckpt'}", *common],
        model_cache,
        cwd=tmp_path,
    )
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-3000:]
    logged = set().union(*read_metrics(evaluated))
    assert {"val/avg@n", "val/pass@1", "val/distinct_correct"} <= logged


# The same global batch on one process (8 prompts a step) and on two DDP ranks (4 each); rollouts are seeded per
# prompt, so both sample the same responses and take the same steps, up to float summation order. The gate is open
# from the start, so STARE's step-wide selection (a count over every rank's tokens) shapes the loss.
DDP_STEPS = [*FAST, "trainer.precision=32-true", "validation.before_fit=false", "trainer.val_check_interval=100",
             "trainer.max_steps=2", "algorithm.stare.target_entropy=10.0"]  # fmt: skip
# Token-level truncated importance sampling of the engine/trainer mismatch, its cap below every ratio the HF
# engine can show (its log-probs are the trainer's up to kernel noise), so that each token's weight is the cap.
MISMATCH_CAP = 0.5
CORRECTED = ["algorithm.mismatch.correction=token", f"algorithm.mismatch.cap={MISMATCH_CAP}"]
SAME_ON_EVERY_LAYOUT = ["loss", "pg_loss", "entropy", "reward/mean", "grad_norm", "response_length/mean",
                        "stare/selected_frac/pos", "stare/selected_frac/neg"]  # fmt: skip


def test_two_process_ddp_fit_matches_one_process_and_weights_tokens_by_the_capped_ratio(tmp_path, model_cache):
    runs = {
        "plain": ["trainer=cpu"],
        "corrected": ["trainer=cpu", *CORRECTED],
        "ddp": ["trainer=ddp", "trainer.accelerator=cpu", "trainer.devices=2", "data.prompts_per_step=4", *CORRECTED],
    }
    for name, overrides in runs.items():
        proc = run_cli(["fit", f"output_dir={tmp_path / name}", *DDP_STEPS, *overrides], model_cache, cwd=tmp_path)
        out, _ = proc.communicate(timeout=900)
        assert proc.returncode == 0, f"{name}: {out[-4000:]}"
    plain, corrected, ddp = (train_rows(read_metrics(tmp_path / name)) for name in runs)
    assert sorted(plain) == sorted(corrected) == sorted(ddp) == [0, 1]

    # Two ranks against one process on the same global batch, the correction on in both.
    for step, want in corrected.items():
        for name in SAME_ON_EVERY_LAYOUT:
            got = ddp[step][f"train/{name}"]
            assert got == pytest.approx(want[f"train/{name}"], abs=1e-5, rel=1e-5), f"step {step}: train/{name}"
    assert any(corrected[step]["train/stare/selected_frac/pos"] > 0 for step in corrected)

    # The token weight, computed here from what mismatch correction=token means: min(pi_train / pi_rollout, cap),
    # where |log pi_train - log pi_rollout| is at most the canary's logged maximum on every token.
    for rows in (corrected, ddp):
        for row in rows.values():
            gap = row["train/rollout/logprob_abs_diff/max"]
            assert gap < 1e-3
            lowest, highest = min(math.exp(-gap), MISMATCH_CAP), min(math.exp(gap), MISMATCH_CAP)
            assert lowest == highest == MISMATCH_CAP
    # Step 0 starts from the same weights and samples the same responses with and without the correction; every
    # token's loss is then scaled by that weight (no other term in this loss), and so is the gradient.
    weight, before, after = MISMATCH_CAP, plain[0], corrected[0]
    for name in ("entropy", "reward/mean", "response_length/mean", "stare/selected_frac/pos"):
        assert after[f"train/{name}"] == pytest.approx(before[f"train/{name}"], abs=1e-6), f"train/{name}"
    for name in ("loss", "pg_loss", "grad_norm"):
        assert before[f"train/{name}"] != 0.0
        want = weight * before[f"train/{name}"]
        assert after[f"train/{name}"] == pytest.approx(want, rel=1e-5, abs=1e-7), f"train/{name}"


def test_packed_fit_with_shared_prompts_matches_the_padded_fit(tmp_path, model_cache):
    """The same run with padding-free micro-batches, one copy of each prompt per group and the fused LM head:
    the same losses, entropies and STARE selections step by step (the gate open from the start)."""
    common = [*FAST, "trainer.max_steps=3", "validation.before_fit=false", "telemetry.same_batch_entropy=false",
              "algorithm.stare.target_entropy=10.0", "forward.micro_batch_tokens=512"]  # fmt: skip
    layouts = {
        "padded": ["forward.packed_sequences=false", "forward.share_prompts=false"],
        "packed": ["forward.packed_sequences=true", "forward.share_prompts=true", "forward.fused_lm_head=true"],
    }
    for name, overrides in layouts.items():
        proc = run_cli(["fit", f"output_dir={tmp_path / name}", *common, *overrides], model_cache, cwd=tmp_path)
        out, _ = proc.communicate(timeout=900)
        assert proc.returncode == 0, out[-4000:]
    padded, packed = (train_rows(read_metrics(tmp_path / name)) for name in layouts)
    assert sorted(packed) == sorted(padded) == [0, 1, 2]
    for step, want in padded.items():
        for name in ["loss", "entropy", "stare/selected_frac/pos", "clip_ratio/high", "response_length/mean"]:
            got = packed[step][f"train/{name}"]
            assert got == pytest.approx(want[f"train/{name}"], abs=1e-5, rel=1e-5), f"step {step}: train/{name}"


def test_nonfinite_loss_skips_the_step_and_training_goes_on(tmp_path, model_cache, monkeypatch):
    from stare_lightning import train
    from stare_lightning.step import runner as runner_file

    calls = []

    def poisoned_once(*args, **kwargs):
        result = micro_batch_loss(*args, **kwargs)
        calls.append(None)
        return dataclasses.replace(result, loss=result.loss * float("nan")) if len(calls) == 1 else result

    micro_batch_loss = runner_file.micro_batch_loss
    monkeypatch.setattr(runner_file, "micro_batch_loss", poisoned_once)
    cfg = compose_run(
        tmp_path, ["trainer.max_steps=2", "validation.before_fit=false", "trainer.val_check_interval=100"]
    )
    module, datamodule = train._setup(cfg)
    trainer = train.build_trainer(cfg)
    module.configure_model()
    before = {n: p.detach().clone() for n, p in module.policy.named_parameters()}
    with pytest.warns(RuntimeWarning, match="non-finite"):
        trainer.fit(module, datamodule=datamodule)
    assert module.optimizer_steps.skipped == 1
    assert trainer.global_step == 2  # two real optimizer steps after the skipped one
    assert all(torch.isfinite(p).all() for p in module.policy.parameters())
    assert any(not torch.equal(before[n], p.detach()) for n, p in module.policy.named_parameters())


def test_malformed_data_fails_before_any_model_is_prepared(tmp_path):
    bad = tmp_path / "train.jsonl"
    bad.write_text('{"prompt": "1+1=", "answer": "2", "verifier": "numeric"}\n{"prompt": "2+2=", "answer": \n')
    cache = tmp_path / "empty_cache"
    proc = run_cli(
        ["fit", f"output_dir={tmp_path / 'run'}", "data=files", f"data.train_files=[{bad}]", "data.val_size=0"],
        str(cache),
        cwd=tmp_path,
    )
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode != 0
    assert str(bad) in out and "line 2" in out
    assert not cache.exists() or not any(cache.iterdir()), "a model was prepared before the data was checked"


def test_notebook_and_comparison_on_real_logs_of_two_runs(tmp_path, model_cache):
    """A `-m` sweep of GRPO-ds and STARE-O1 for a few steps, then the notebook and the comparison plot on its logs."""
    from stare_lightning.analysis.compare import compare
    from tests.test_metrics_notebook import execute_notebook

    sweep = tmp_path / "sweep"
    proc = run_cli(
        ["fit", "-m", f"hydra.sweep.dir={sweep}", *FAST, "algorithm=grpo_ds,stare_o1", "trainer.max_steps=3"],
        model_cache,
        cwd=tmp_path,
    )  # one Hydra multirun: a job directory per algorithm
    out, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, out[-3000:]
    jobs = sorted(p for p in sweep.iterdir() if p.is_dir())
    assert [p.name.split("_", 1)[0] for p in jobs] == ["0", "1"]
    assert "algorithm=grpo_ds" in jobs[0].name and "algorithm=stare_o1" in jobs[1].name
    runs = [job / "logs" for job in jobs]
    assert all(len(train_rows(read_metrics(job))) == 3 for job in jobs)
    nb = execute_notebook(runs, tmp_path / "figures")
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors, errors
    assert len(list((tmp_path / "figures").glob("*.png"))) == 3
    png = compare(sweep)
    assert png.is_file() and png.stat().st_size > 10_000


SMOLLM2 = [
    "experiment=smollm2_countdown",
    "callbacks=minimal",
    "summary=false",
    "data.train_size=64",
    "data.val_size=2",
    "data.prompts_per_step=2",
    "rollout.n=2",
    "rollout.max_new_tokens=8",
    "callbacks.model_checkpoint.save_last=false",  # no checkpoint of SmolLM2 and its optimizer (1.6 GB) to write
    # Eight tokens never finish an answer: every group's rewards are 0, and dynamic sampling would sample each step
    # ten times over (max_generation_batches) for nothing this wiring test compares.
    "algorithm.collection.dynamic_sampling=false",
    "rollout.val_n=2",
    "validation.pass_k=[1,2]",
    "trainer.val_check_interval=100",
]


# The largest mean |log-prob difference| between the engine and the trainer a synced fp32 engine may show (the
# stale control below shows what an engine that missed its syncs shows).
CANARY_BOUND = 1e-3


@pytest.mark.vllm
# The tiny model's colocated vLLM fit, and its server twin, are tests/test_fit_server.py's.
@pytest.mark.parametrize("overrides", [pytest.param(SMOLLM2, id="smollm2")])
def test_fit_with_vllm_rollouts(tmp_path, model_cache, overrides):
    proc = run_cli(
        [
            "fit",
            f"output_dir={tmp_path}",
            *overrides,
            "rollout=vllm",
            "trainer.max_steps=2",
            "validation.before_fit=false",
        ],
        model_cache,
        cwd=tmp_path,
    )
    out, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, out[-4000:]
    steps = train_rows(read_metrics(tmp_path))
    assert sorted(steps) == [0, 1]
    # The engine received the trainer's weights: its log-probs match the trainer's forward (fp32).
    assert all(r["train/rollout/logprob_abs_diff/mean"] < CANARY_BOUND for r in steps.values())
    if (
        overrides is SMOLLM2
    ):  # the same fit on a separate vLLM server takes the same steps (the tiny model's: test_fit_server)
        server = tmp_path / "server"
        args = ["fit", f"output_dir={server}", *overrides, "rollout=server", "trainer.max_steps=2"]
        proc = run_cli([*args, "validation.before_fit=false"], model_cache, cwd=tmp_path)
        out, _ = proc.communicate(timeout=900)
        assert proc.returncode == 0, out[-4000:]
        served = train_rows(read_metrics(server))
        assert sorted(served) == [0, 1]
        for step, row in steps.items():
            for name in ("loss", "entropy", "reward/mean", "response_length/mean", "grad_norm"):
                want, have = row[f"train/{name}"], served[step][f"train/{name}"]
                assert have == pytest.approx(want, abs=1e-5, rel=1e-5), f"step {step}: train/{name}"


# The command line with vLLM's engine as the trainer builds it, but for its weight syncs: it takes the weights it
# starts with, then skips every later sync, so from the second step on it samples from the first step's policy.
STALE_ENGINE = """
import sys

from stare_lightning.__main__ import main
from stare_lightning.rollout import vllm as vllm_rollout


class StaleEngine(vllm_rollout.VLLMRolloutEngine):
    syncs = 0

    def sync_weights(self, model):
        StaleEngine.syncs += 1
        if StaleEngine.syncs == 1:
            return super().sync_weights(model)
        print(f"stale engine: weight sync {StaleEngine.syncs} skipped", flush=True)


vllm_rollout.VLLMRolloutEngine = StaleEngine
main(sys.argv[1:])
"""


@pytest.mark.vllm
def test_a_vllm_engine_that_misses_its_weight_syncs_trips_the_canary(tmp_path, model_cache):
    """The control of the bound above: the same fit with an engine left stale is within it at step 0 (the engine
    still holds the starting weights) and far above it from the first update on; with patience 2 the run stops at
    the second stale step with the canary's error."""
    args = [*FAST, "rollout=vllm", "trainer.max_steps=3", "validation.before_fit=false",
            f"rollout.canary_threshold={CANARY_BOUND}", "rollout.canary_patience=2"]  # fmt: skip
    proc = run_cli(["fit", f"output_dir={tmp_path}", *args], model_cache, cwd=tmp_path, entry=("-c", STALE_ENGINE))
    out, _ = proc.communicate(timeout=900)
    assert proc.returncode != 0, out[-4000:]
    assert "stale engine: weight sync 2 skipped" in out and "weight sync 4 skipped" not in out, out[-4000:]
    found = re.search(r"Rollout engine and trainer disagree: mean \|logprob difference\| (\S+) ", out)
    assert found, out[-4000:]
    assert float(found.group(1)) > 10 * CANARY_BOUND, found.group(0)
    steps = train_rows(read_metrics(tmp_path))  # the steps logged before the error: 0 (in sync) and 1 (stale)
    assert sorted(steps) == [0, 1]
    gaps = [steps[step]["train/rollout/logprob_abs_diff/mean"] for step in (0, 1)]
    assert gaps[0] < CANARY_BOUND < 10 * CANARY_BOUND < gaps[1], gaps


@pytest.mark.parametrize("algorithm", ["gspo", "cispo", "stare_gspo", "stare_cispo"])
def test_gspo_and_cispo_train_with_and_without_stare(tmp_path, model_cache, algorithm):
    """Two rollout batches of each new policy loss in a real fit, two mini-batches each (so the ratio moves off 1
    and the second optimizer step's clip or IS weight is exercised); STARE's gate open, its weights applied."""
    from stare_lightning import train

    common = ["trainer.max_steps=4", "validation.before_fit=false", "trainer.val_check_interval=100"]
    cfg = compose_run(tmp_path, [*common, f"algorithm={algorithm}", "algorithm.update.mini_batches=2",
                                 "algorithm.stare.target_entropy=100.0"])  # fmt: skip
    module, datamodule = train._setup(cfg)
    module.configure_model()
    before = {n: p.detach().clone() for n, p in module.policy.named_parameters()}
    train.build_trainer(cfg).fit(module, datamodule=datamodule)
    rows = train_rows(read_metrics(tmp_path))
    assert len(rows) == 2 and module.plan.forward.layout.packed
    for row in rows.values():
        assert math.isfinite(row["train/loss"]) and math.isfinite(row["train/grad_norm"])
        assert row["train/stare/gate_on"] == float(algorithm.startswith("stare"))
    first = rows[min(rows)]
    assert first["train/grad_norm"] > 0 and first["train/frac_zero_std_groups"] < 1.0
    assert any(not torch.equal(before[n], p.detach()) for n, p in module.policy.named_parameters())
