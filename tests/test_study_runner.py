"""The study runner (scripts/smollm2_study.sh) on the tiny model: each job its own process, a killed runner takes
its job down with it, and running it again resumes that job from its checkpoint, skips the finished ones and
writes the summaries."""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys

import pytest

from tests.test_fit import FAST, REPO, read_metrics, train_rows, wait_for_checkpoint

SCRIPT = REPO / "scripts" / "smollm2_study.sh"
STEPS = 4
STUDY = [
    *FAST,
    "data.prompts_per_step=4",
    "rollout.n=4",
    f"trainer.max_steps={STEPS}",
    "callbacks.model_checkpoint.every_n_train_steps=2",
    "trainer.val_check_interval=100",
    "validation.before_fit=false",
]


def _runner(out, data, model_cache):
    """The study runner started in the directory that holds its output (its fits' Hydra folders land there)."""
    env = {
        **os.environ,
        "PYTHON": sys.executable,
        "STUDY": " ".join(STUDY),
        "SEEDS": "0",
        "ARM_NAMES": "grpo_ds stare_o1",
        "DATA": str(data),
        "STARE_LIGHTNING_CACHE": model_cache,
    }
    return subprocess.Popen(
        ["bash", str(SCRIPT), str(out)],
        cwd=out.parent,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def _finish(proc, timeout=900):
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out[-4000:]
    return out


def _nobody_holds(lock):
    with open(lock, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        fcntl.flock(handle, fcntl.LOCK_UN)
        return True


@pytest.mark.slow
def test_a_killed_study_resumes_its_job_and_skips_the_finished_ones(tmp_path, model_cache):
    out, data = tmp_path / "study", tmp_path / "data"
    first, second = out / "grpo_ds" / "seed0", out / "stare_o1" / "seed0"
    checkpoint = second / "checkpoints" / "last.ckpt"

    runner = _runner(out, data, model_cache)  # the first job finishes, the second is killed in its run
    wait_for_checkpoint(runner, checkpoint)
    os.kill(runner.pid, signal.SIGTERM)  # the runner alone, as a user's `kill` would
    runner.communicate(timeout=120)
    # The fit went down with the runner: nothing holds the job, it is not marked finished, its checkpoint stays.
    assert _nobody_holds(second / ".lock")
    assert not (second / "finished").exists() and checkpoint.is_file()
    assert (first / "finished").is_file() and not (first / "checkpoints").exists()
    rows = len(read_metrics(first))

    again = _finish(_runner(out, data, model_cache))
    assert "grpo_ds seed 0: finished already" in again and "stare_o1 seed 0: resuming" in again
    assert len(read_metrics(first)) == rows  # not run again
    assert (second / "finished").is_file() and not (second / "checkpoints").exists()
    for job in (first, second):
        assert sorted(train_rows(read_metrics(job))) == list(range(STEPS))
    for label in ("grpo_ds_seed0", "stare_o1_seed0"):
        assert (data / label / "metrics.csv").is_file()
    assert (data / "seed_statistics.csv").is_file()


def test_an_unknown_arm_is_refused_before_any_job(tmp_path):
    env = {**os.environ, "ARM_NAMES": "grpo_ds stare_o2", "PYTHON": sys.executable}
    done = subprocess.run(
        ["bash", str(SCRIPT), str(tmp_path / "other")], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert done.returncode == 2
    assert "ARM_NAMES: unknown arm 'stare_o2'" in done.stderr and "stare_o1_adaptive" in done.stderr
    assert not (tmp_path / "other").exists()
