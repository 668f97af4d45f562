"""The guide "STARE in TRL and in your own loop" (docs/guides/trl.md): its scripts are the files in
docs/examples/integrations/, and both run on the tiny model (CPU, seconds): the loop saves a STARE state that loads
and carries its two steps, TRL's run logs STARE's metrics."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from stare_lightning.integrations.pytorch import STARE, STARESettings
from tests.needs import require

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "docs" / "examples"
GUIDE = REPO / "docs" / "guides" / "trl.md"


def test_the_guide_shows_every_script_as_it_is():
    shown = dict(re.findall(r"<!-- example: (\S+) -->\n```python\n(.*?)```\n", GUIDE.read_text(), flags=re.DOTALL))
    assert sorted(shown) == sorted(f"integrations/{p.name}" for p in (EXAMPLES / "integrations").glob("*.py"))
    for name, code in shown.items():
        assert code == (EXAMPLES / name).read_text(), f"{name}: the guide's code differs from the file"


def _run(script: str, *args, cwd: Path) -> str:
    env = {**os.environ, "PYTHONPATH": str(REPO), "TRL_EXPERIMENTAL_SILENCE": "1"}
    proc = subprocess.run([sys.executable, str(EXAMPLES / "integrations" / script), *map(str, args)], cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_the_loop_runs_and_its_checkpoint_resumes_stare(tiny_dir, tmp_path):
    out = _run("stare_loop.py", tiny_dir, tmp_path / "last.pt", cwd=tmp_path)
    assert "stare/gate_on" in out
    state = torch.load(tmp_path / "last.pt")["stare"]
    resumed = STARE(STARESettings(variant="C2", target_entropy=0.3), group_size=4)
    resumed.load_state_dict(state)
    assert resumed.controller.num_updates == 2 and resumed.last_entropy == pytest.approx(4.62, abs=0.05)


def test_the_trl_script_runs_and_logs_stare(tiny_dir, tmp_path):
    require("trl", "datasets")
    out = _run("stare_trl.py", tiny_dir, tmp_path / "run", cwd=tmp_path)
    assert "'stare/gate_on': 1.0" in out and "'stare/selected_frac/pos'" in out  # the example's gate opened
