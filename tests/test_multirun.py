"""A Hydra sweep runs its jobs in one process: each job's models and engine are freed before the next starts, and
a sweep directory that already holds those jobs is refused instead of appended to."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.test_fit import FAST, read_metrics, run_cli, train_rows

pytestmark = pytest.mark.slow

# Runs the command line's entry in this interpreter, counting the training modules alive as each job starts. By weak
# reference: gc.get_objects() leaves out what a run froze (stare_lightning/collector.py), so it could not see a leak.
DRIVER = """
import gc, sys, weakref
from stare_lightning import cli
from stare_lightning.module import STAREModule

run = cli.run
built = []
from_config = STAREModule.from_config


def tracked(*args, **kwargs):
    module = from_config(*args, **kwargs)
    built.append(weakref.ref(module))
    return module


def counted(subcommand, cfg):
    gc.collect()
    print("live modules as a job starts:", sum(ref() is not None for ref in built), flush=True)
    return run(subcommand, cfg)


STAREModule.from_config = tracked
cli.run = counted
from stare_lightning.__main__ import main
main(sys.argv[1:])
"""


def test_a_sweep_frees_each_job_and_refuses_to_append_to_a_finished_one(tmp_path, model_cache):
    sweep = tmp_path / "sweep"
    args = ["fit", "-m", f"hydra.sweep.dir={sweep}", "seed=1,2,3", *FAST, "trainer.max_steps=2", "summary=false"]
    env = {**os.environ, "STARE_LIGHTNING_CACHE": model_cache}
    driver = [sys.executable, "-c", DRIVER, *args]
    proc = subprocess.run(driver, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    counts = [line.rsplit(" ", 1)[1] for line in proc.stdout.splitlines() if line.startswith("live modules")]
    assert counts == ["0", "0", "0"], f"modules of earlier jobs still alive: {counts}"
    jobs = [next(sweep.glob(f"{job}_*")) for job in range(3)]  # <job number>_<its overrides>
    memory = [train_rows(read_metrics(job))[1]["train/memory/current_gib"] for job in jobs]
    assert memory[2] <= 1.1 * memory[0], f"resident memory grew from job to job: {memory} GiB"

    again = run_cli(args, model_cache, cwd=tmp_path)
    out, _ = again.communicate(timeout=600)
    assert again.returncode == 2, out[-3000:]
    assert "already holds a run" in out and "Traceback" not in out, out[-3000:]
