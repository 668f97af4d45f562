"""One prepared check of the GPU paths, for a bare GPU machine with no network (scripts/gpu_check.sh runs it).

Steps, each a child process with its own time limit, each reported whether or not another failed:
  environment    interpreter, torch, CUDA, the device; the carried packages import, at versions pyproject.toml allows
  correctness    STARE weights, the policy loss and its gradient, the fused LM head, telemetry on the device
                 against float64 on the CPU (scripts/gpu_check_tensors.py)
  fit_gpu        a tiny-model fit, trainer=gpu rollout=hf
  fit_fsdp_bf16  trainer=fsdp on one device (an NCCL process group) in bf16 with fp32 master weights and the memory
                 levers on (fused LM head, gradient checkpointing, packed micro-batches); it writes a checkpoint
  resume         the same run resumed from that checkpoint for one more step
  fit_fsdp_fp16  trainer=fsdp_fp16: fp16 compute with the dynamic loss scale (skipped steps and last scale reported)
  performance    update tokens/s, MFU and peak memory of a Qwen2.5-1.5B-shaped model, HF generation tokens/s
                 (scripts/gpu_check_perf.py)
  fit_fsdp_lora  trainer=fsdp in bf16 with rank-8 LoRA adapters and a KL term whose reference is the policy with its
                 adapters off (no second model); last, so that a short loan loses it before the performance figures
Results go to OUT/gpu_check.json and a short OUT/gpu_check.md; each step's output to OUT/logs/<step>.log.

Every fit must learn, not only run: its rewards differ within some group, so advantages and the loss are nonzero and
the loss moves between steps, and the LoRA fit's KL leaves 0 after its first update. A fit that runs but shows no
gradient is reported as failed, with its figures.

With --cpu-dry-run every step runs on the CPU at tiny sizes (seconds), so the check is exercised by the test suite;
fp16 fits need a GPU (the project refuses them on CPUs), so that step is reported as skipped there.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# Step name -> time limit on a GPU, in seconds: 500 s if every step ran to its limit, about the 8 minutes a check may
# take so that a rerun fits a 15-minute loan (the fits after the first reuse its cold start and take far less).
STEPS = {
    "environment": 30,
    "correctness": 60,
    "fit_gpu": 70,
    "fit_fsdp_bf16": 70,
    "resume": 50,
    "fit_fsdp_fp16": 60,
    "performance": 120,
    "fit_fsdp_lora": 40,
}
DRY_RUN_LIMIT_S = 120
FIT = ["debug=fast", "rollout=hf", "validation.before_fit=false", "trainer.max_steps=3", "summary=false",
       "logger=csv"]  # fmt: skip
LEVERS = ["forward.fused_lm_head=true", "model.gradient_checkpointing=true", "forward.packed_sequences=true",
          "telemetry.same_batch_entropy=false"]  # fmt: skip
# One warm-up of the tiny model for every fit, on the GPU and in the dry run alike (cached after the first fit). Its
# length sets what the fits can learn from: on debug=fast's 256 countdown records the warmed-up model answers about
# 30% of sampled responses correctly after 100 steps, so most groups mix right and wrong answers and the advantage is
# nonzero. After 5 or 30 steps it is never right (every reward 0, the loss 0 at every step); after 300 it is nearly
# always right (every reward 1): either way no gradient reaches the weights.
COLD_START = ["model.cold_start.steps=100"]
METRIC_COLUMNS = {
    "loss": "train/loss",
    "entropy": "train/entropy",
    "reward": "train/reward/mean",
    "step_s": "train/time/step_s",
    "peak_gib": "train/memory/peak_gib",
    "nonfinite_skipped": "train/nonfinite_skipped",
    "loss_scale": "train/loss_scale",
}


def fit_overrides(step: str, dry_run: bool) -> list[str] | None:
    """The fit's overrides for ``step``; None where the step cannot run on this kind of machine."""
    device = ["trainer.accelerator=cpu"] if dry_run else ["trainer.accelerator=gpu"]
    fsdp = ["trainer=fsdp", "trainer.devices=1", *device, *COLD_START]
    return {
        "fit_gpu": ["trainer=gpu", *device, *COLD_START],
        "fit_fsdp_bf16": [*fsdp, "trainer.max_steps=2", *LEVERS],
        "resume": [*fsdp, "trainer.max_steps=3", "ckpt_path=last", *LEVERS],
        "fit_fsdp_fp16": None if dry_run else ["trainer=fsdp_fp16", "trainer.devices=1", *device, *COLD_START],
        "fit_fsdp_lora": [*fsdp, "trainer.max_steps=2", "model.lora.rank=8", "algorithm.kl.coef=0.05"],
    }[step]


def _metrics(run_dir: Path) -> dict:
    rows = [r for r in csv.DictReader(open(run_dir / "logs" / "metrics.csv")) if r.get("train/loss")]
    last = {name: float(rows[-1][column]) for name, column in METRIC_COLUMNS.items() if rows and rows[-1].get(column)}
    kl = [float(r["train/kl"]) for r in rows if r.get("train/kl")]  # with a KL term: 0 while the policy is the base
    return {
        "steps_logged": [int(r["step"]) for r in rows],
        "last": last,
        "loss_by_step": [float(r["train/loss"]) for r in rows],
        "reward_std_by_step": [float(r["train/reward/std"]) for r in rows if r.get("train/reward/std")],
        **({"kl_by_step": kl} if kl else {}),
    }


def learning_problems(step: str, metrics: dict) -> list[str]:
    """Why ``metrics`` show no gradient reaching the weights (empty when they do): rewards that never differ within
    a group, a loss that is 0 at every step or never moves, or, for the LoRA fit, a KL still 0 after the first
    update (its adapters start at B = 0, so the KL is 0 at step 0 only)."""
    losses, problems = metrics["loss_by_step"], []
    if not any(std > 0 for std in metrics["reward_std_by_step"]):
        problems.append("every step's rewards agree (reward std 0): no advantage to learn from")
    if not any(losses):
        problems.append("the loss is 0 at every step")
    elif len(set(losses)) < 2:
        problems.append(f"the loss never moves ({losses[0]:g} at every step)")
    if step == "fit_fsdp_lora" and not any(kl > 0 for kl in metrics.get("kl_by_step", [])[1:]):
        problems.append(f"the KL stays 0 after the first update (by step: {metrics.get('kl_by_step')})")
    return problems


def run_fit(step: str, out: Path, dry_run: bool) -> dict:
    overrides = fit_overrides(step, dry_run)
    if overrides is None:
        return {"status": "skipped", "reason": "fp16 needs a GPU: the project refuses param_dtype=float16 on CPUs"}
    run_dir = out / "runs" / ("fit_fsdp_bf16" if step == "resume" else step)
    command = [sys.executable, "-m", "stare_lightning", "fit", *FIT, *overrides, f"output_dir={run_dir}",
               f"hydra.run.dir={run_dir}/hydra"]  # fmt: skip
    started = time.perf_counter()
    proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    wall = time.perf_counter() - started
    print(" ".join(command[1:]), proc.stdout[-4000:], proc.stderr[-8000:], sep="\n")
    if proc.returncode != 0:
        raise RuntimeError(f"the fit exited with {proc.returncode}: {proc.stderr.strip().splitlines()[-1:]}")
    metrics = _metrics(run_dir)
    return {"overrides": overrides, "wall_s": wall, **metrics, "learning_problems": learning_problems(step, metrics),
            "checkpoint": (run_dir / "checkpoints" / "last.ckpt").exists()}  # fmt: skip


def run_environment(dry_run: bool) -> dict:
    import ctypes.util
    import importlib.metadata

    import torch
    from packaging.requirements import Requirement

    from scripts.gpu_packages import project_requirements

    outside = {}
    for requirement in project_requirements():
        version = importlib.metadata.version(requirement.name)
        if not requirement.specifier.contains(version, prereleases=True):
            outside[requirement.name] = f"{version} not in {requirement.specifier}"
    import hydra  # noqa: F401  (the carried packages import)
    import math_verify  # noqa: F401
    import omegaconf  # noqa: F401

    cuda = torch.cuda.is_available()
    if not cuda and not dry_run:
        raise RuntimeError("torch sees no CUDA device")
    report = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda,
              "device": torch.cuda.get_device_name(0) if cuda else "cpu",
              "packages": {Requirement(r).name: importlib.metadata.version(Requirement(r).name)
                           for r in ("lightning", "transformers", "torchmetrics", "hydra-core", "omegaconf",
                                     "math-verify")}}  # fmt: skip
    # The verifier worker confines itself with a seccomp filter that libseccomp builds: without it every fit fails.
    report["libseccomp"] = ctypes.util.find_library("seccomp")
    if cuda:
        report["device_memory_gib"] = torch.cuda.get_device_properties(0).total_memory / 2**30
    if outside:
        raise RuntimeError(f"installed versions outside pyproject.toml's ranges: {outside}")
    return report


def run_step(step: str, out: Path, dry_run: bool) -> dict:
    """One step, in this process (a child of the orchestrator). A fit's step only starts the fit's own process, so
    it does not import torch (seconds of CPU a step)."""
    if step == "environment":
        return run_environment(dry_run)
    if step not in ("correctness", "performance"):
        return run_fit(step, out, dry_run)
    import torch

    device = torch.device("cpu" if dry_run else "cuda")
    if step == "correctness":
        from scripts import gpu_check_tensors as tensors

        report = tensors.run(device, tensors.DRY_RUN_SIZES if dry_run else tensors.GPU_SIZES)
        if not report["passed"]:
            raise RuntimeError(f"a device result is outside its tolerance: {json.dumps(report)}")
        return report
    from scripts import gpu_check_perf as perf

    return perf.run(device, perf.DRY_RUN_SIZES if dry_run else perf.GPU_SIZES)


def _in_child(step: str, out: Path, dry_run: bool, limit: float) -> dict:
    """Run ``step`` as a child process group, killed whole past ``limit``; its output goes to OUT/logs/<step>.log."""
    result_file = out / "logs" / f"{step}.json"
    command = [sys.executable, __file__, "--step", step, "--out", str(out), "--result", str(result_file)]
    command += ["--cpu-dry-run"] if dry_run else []
    started = time.perf_counter()
    with open(out / "logs" / f"{step}.log", "w") as log:
        child = subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = child.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
            code = None
    seconds = time.perf_counter() - started
    if code is None:
        return {"status": "timeout", "seconds": seconds, "error": f"killed after {limit:.0f} s"}
    if result_file.exists():
        return {"seconds": seconds, **json.loads(result_file.read_text())}
    tail = (out / "logs" / f"{step}.log").read_text().strip().splitlines()[-3:]
    return {"status": "failed", "seconds": seconds, "error": f"exit code {code}: {' | '.join(tail)}"}


def _child_main(step: str, out: Path, dry_run: bool, result_file: Path) -> None:
    try:
        result = run_step(step, out, dry_run)
        if result.get("learning_problems"):  # it ran, but no gradient reached the weights: the figures still go out
            result = {"status": "failed", "error": "; ".join(result["learning_problems"]), "results": result}
        elif result.get("status") != "skipped":
            result = {"status": "ok", "results": result}
    except Exception as error:  # the orchestrator reports it and goes on with the next step
        import traceback

        traceback.print_exc()
        result = {"status": "failed", "error": f"{type(error).__name__}: {str(error)[:2000]}"}
    result_file.write_text(json.dumps(result, indent=2, default=str))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-dry-run", action="store_true", help="every step on the CPU at tiny sizes")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or REPO / "outputs" / "gpu_check"))
    parser.add_argument("--steps", nargs="*", choices=list(STEPS), default=list(STEPS))
    parser.add_argument("--step", choices=list(STEPS), help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    out = args.out.resolve()
    if args.step:
        return _child_main(args.step, out, args.cpu_dry_run, args.result)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    report = {"dry_run": args.cpu_dry_run, "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "steps": {}}
    for step in args.steps:
        limit = DRY_RUN_LIMIT_S if args.cpu_dry_run else STEPS[step]
        report["steps"][step] = result = _in_child(step, out, args.cpu_dry_run, limit)
        print(f"[gpu_check] {step}: {result['status']} ({result['seconds']:.1f} s)", flush=True)
        (out / "gpu_check.json").write_text(json.dumps(report, indent=2, default=str))
    from scripts.gpu_check_report import write_markdown

    (out / "gpu_check.md").write_text(write_markdown(report))
    print(f"[gpu_check] {out / 'gpu_check.json'}, {out / 'gpu_check.md'}")
    if any(r["status"] not in ("ok", "skipped") for r in report["steps"].values()):
        sys.exit(1)


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))  # `scripts.*` and the project, from the checkout
    main()
