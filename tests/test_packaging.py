"""What ships: the wheel's package lists equal the source tree, and a built wheel, installed without the checkout,
runs ``fit`` and ``evaluate`` from any directory (docs/getting-started.md's claim for users who install with pip)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import tomllib

from tests.test_evaluation import _write_benchmarks
from tests.test_fit import FAST

REPO = Path(__file__).resolve().parents[1]
# What a build must not see or write next to: the environment, caches, and a build's own leftovers (setuptools puts
# build/ and the .egg-info beside the sources it builds, so it builds a copy of the checkout without them).
NOT_SOURCES = shutil.ignore_patterns(
    ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache", ".ruff_cache", "outputs",
    "multirun", "runs", "lightning_logs",
)  # fmt: skip


def _setuptools_settings() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_the_package_lists_equal_the_tree():
    settings = _setuptools_settings()
    code = {
        ".".join(path.parent.relative_to(REPO).parts)
        for path in (REPO / "stare_lightning").rglob("__init__.py")
        if "__pycache__" not in path.parts
    }
    groups = {path.name for path in (REPO / "conf").iterdir() if path.is_dir() and any(path.glob("*.yaml"))}
    config = {"stare_lightning.conf", *(f"stare_lightning.conf.{group}" for group in groups)}
    assert sorted(settings["packages"]) == sorted(code | config), "pyproject.toml's packages list is out of date"
    assert set(settings["package-data"]) == config and all(v == ["*.yaml"] for v in settings["package-data"].values())


def _run(command: list[str], cwd: Path, env: dict, timeout: int = 900) -> str:
    proc = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{command[:4]} failed:\n{(proc.stdout + proc.stderr)[-4000:]}"
    return proc.stdout + proc.stderr


@pytest.mark.slow
def test_a_built_wheel_runs_fit_and_evaluate_outside_the_checkout(tmp_path, model_cache):
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1", "STARE_LIGHTNING_CACHE": model_cache}
    env.pop("PYTHONPATH", None)
    sources = shutil.copytree(REPO, tmp_path / "sources", ignore=NOT_SOURCES, symlinks=True)
    build = ["wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), str(sources)]
    _run([sys.executable, "-m", "pip", *build], tmp_path, env)
    wheel = next(tmp_path.glob("stare_lightning-*.whl"))
    # A fresh environment holding the wheel; its dependencies (torch, vLLM: gigabytes) are read from this one's
    # site-packages through a .pth line, which adds the directory but none of its .pth files, so this checkout's
    # editable install stays invisible.
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], tmp_path, env)
    python = venv / "bin" / "python"
    site = Path(
        _run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], tmp_path, env).strip()
    )
    (site / "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    _run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheel)], tmp_path, env)

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    where = _run([str(python), "-c", "import stare_lightning, sys; print(stare_lightning.__file__)"], elsewhere, env)
    assert where.strip().startswith(str(site)), where

    run = elsewhere / "run"
    _run(
        [str(python), "-m", "stare_lightning", "fit", f"output_dir={run}", *FAST, "trainer.max_steps=2"], elsewhere, env
    )
    assert (run / "checkpoints" / "last.ckpt").is_file()
    files = _write_benchmarks(tmp_path)
    val_files = f"data.val_files=[{','.join(map(str, files))}]"
    evaluation = elsewhere / "evaluation"
    args = ["evaluate", f"output_dir={evaluation}", *FAST, val_files, "rollout.val_n=2", "validation.pass_k=[1,2]"]
    _run([str(python), "-m", "stare_lightning", *args], elsewhere, env)
    assert set(json.loads((evaluation / "results.json").read_text())) == {"bench_a", "bench_b", "average"}
