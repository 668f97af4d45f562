"""A config from someone else (overrides, a sweep, Hydra's own node) runs nothing: through the real command line.

Each payload would create a marker file if anything called it; each run must stop with one line naming the key,
before Hydra or the project constructs anything.
"""

from __future__ import annotations

import os

import pytest

from tests import forked_cli


def _run(tmp_path, *args):
    env = {**os.environ, "STARE_LIGHTNING_CACHE": str(tmp_path / "cache")}
    command = [*args, f"hydra.run.dir={tmp_path / 'run'}"]
    if "-m" in args:
        command.append(f"hydra.sweep.dir={tmp_path / 'sweep'}")
    return forked_cli.run(command, cwd=tmp_path, env=env, timeout=300)


@pytest.mark.parametrize(
    "payload, key",
    [
        # The probe's finding: Lightning's class-path helper handed os.system as a "class".
        (
            "+callbacks.x={_target_:lightning.pytorch.cli.instantiate_class,args:[MARK],init:{class_path:os.system}}",
            "callbacks.x._target_='lightning.pytorch.cli.instantiate_class' is not allowed",
        ),
        ("+callbacks.x={_target_:os.system,command:MARK}", "callbacks.x._target_='os.system' is not allowed"),
        ("allowed_targets=[os.system]", "allowed_targets[0]='os.system' cannot be trusted"),
        ("+hydra.callbacks.x={_target_:os.system,command:MARK}", "hydra.callbacks.x._target_='os.system'"),
        ("hydra.job_logging.handlers.console.class=os.system", "hydra.job_logging.handlers.console.class"),
        ("+hydra.job.env_set.LD_PRELOAD=/tmp/evil.so", "hydra.job.env_set.LD_PRELOAD is not allowed"),
    ],
)
def test_a_crafted_config_runs_nothing(tmp_path, payload, key):
    mark = tmp_path / "ran"
    proc = _run(tmp_path, "validate", payload.replace("MARK", f"'touch {mark}'"))
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert key in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr[-3000:]
    assert not mark.exists() and not (tmp_path / "run").exists() and not (tmp_path / "cache").exists()


def test_a_sweep_is_checked_in_every_value(tmp_path):
    """The second value of a sweep, not only the first, is composed and checked before any job starts."""
    mark = tmp_path / "ran"
    evil = f"{{_target_:os.system,command:'touch {mark}'}}"
    proc = _run(tmp_path, "fit", "-m", f"+callbacks.x={{_target_:lightning.pytorch.callbacks.Timer}},{evil}")
    assert proc.returncode == 2 and "callbacks.x._target_='os.system' is not allowed" in proc.stderr, proc.stderr
    assert not mark.exists() and not (tmp_path / "sweep").exists()


def test_hydras_pickled_config_rerun_is_refused(tmp_path):
    proc = _run(tmp_path, "fit", "--experimental-rerun", str(tmp_path / "config.pickle"))
    assert proc.returncode == 2 and "--experimental-rerun" in proc.stderr and "unpickles" in proc.stderr
