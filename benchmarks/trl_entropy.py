"""Entropy over training steps: TRL's GRPO with and without STARE (stare_lightning.integrations.trl) beside this
project's run of the same job, on a CPU.

The job: the offline default's tiny model after its cold start (cached), 3-number countdown prompts (this project's
training records, plain style), 16 prompts x 8 samples per step, at most 16 new tokens at temperature 1, the
countdown verifier as the reward, lr 3e-4, the clipped token-mean loss (clip 0.2 / 0.28, no KL), STARE-O1 with the
offline default's W = 3 and target entropy 0.3. Departures between the loops: TRL's GRPO has no dynamic sampling, so
this project's runs here turn it off too; TRL tokenizes the prompt itself and trains without position ids; TRL's
entropy is its loss forward's token mean (on-policy, the same quantity as this project's ``train/entropy``).

    pip install -e ".[trl]"
    python benchmarks/trl_entropy.py --steps 100 --out /tmp/trl_entropy    # entropy.json and entropy.png
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

ARMS = ("project_grpo", "project_stare_o1", "trl_grpo", "trl_stare_o1")
LR, N, PROMPTS_PER_STEP, MAX_NEW_TOKENS, W, TARGET = 3e-4, 8, 16, 16, 3.0, 0.3
COMMON = ["trainer.val_check_interval=100000", "validation.before_fit=false", "callbacks=minimal", "summary=false",
          "logger=[csv]", "algorithm.collection.dynamic_sampling=false", "rollout=hf"]  # fmt: skip


def project_worker(arm: str, steps: int, out_dir: Path) -> list[float]:
    from stare_lightning import train
    from stare_lightning.cli import compose, prepare_config

    algorithm = "algorithm=grpo_ds" if arm == "project_grpo" else "algorithm=stare_o1"
    overrides = [f"output_dir={out_dir}", f"trainer.max_steps={steps}", algorithm, *COMMON]
    cfg = prepare_config(compose(overrides))[1]
    module, datamodule = train._setup(cfg)
    train.build_trainer(cfg).fit(module, datamodule=datamodule)
    with open(out_dir / "logs" / "metrics.csv") as handle:
        return [float(r["train/entropy"]) for r in csv.DictReader(handle) if r.get("train/entropy")]


def trl_worker(arm: str, steps: int, out_dir: Path) -> list[float]:
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from stare_lightning import train
    from stare_lightning.cli import compose, prepare_config
    from stare_lightning.data.datamodule import PromptDataModule
    from stare_lightning.integrations.trl import STAREGRPOTrainer, STARESettings
    from stare_lightning.rewards.registry import get_verifier

    cfg = prepare_config(compose([f"output_dir={out_dir}", *COMMON]))[1]
    datamodule = PromptDataModule(cfg.data, tokenizer=None)
    datamodule.load_records()
    model_dir = train.prepare_model(cfg, datamodule)  # the cached cold start this project's runs train from
    records = datamodule.train_records
    by_prompt = {r.prompt: r for r in records}

    def reward(prompts, completions, **kwargs):
        out = []
        for prompt, completion in zip(prompts, completions):
            record = by_prompt[prompt]
            out.append(float(get_verifier(record.verifier)(completion, record.answer, record.metadata)))
        return out

    config = GRPOConfig(
        output_dir=str(out_dir), max_steps=steps, learning_rate=LR, per_device_train_batch_size=PROMPTS_PER_STEP * N,
        num_generations=N, max_completion_length=MAX_NEW_TOKENS, temperature=1.0, loss_type="dapo", beta=0.0,
        epsilon=0.2, epsilon_high=0.28, use_cpu=True, bf16=False, logging_steps=1, report_to="none",
        save_strategy="no", seed=0,
    )  # fmt: skip
    dataset = Dataset.from_list([{"prompt": r.prompt} for r in records])
    kwargs = dict(model=str(model_dir), reward_funcs=reward, args=config, train_dataset=dataset)
    if arm == "trl_stare_o1":
        trainer = STAREGRPOTrainer(**kwargs, stare=STARESettings(w=W, target_entropy=TARGET))
    else:
        trainer = GRPOTrainer(**kwargs)
    trainer.train()
    return [row["entropy"] for row in trainer.state.log_history if "entropy" in row]


def run(arm: str, steps: int) -> list[float]:
    with tempfile.TemporaryDirectory(prefix=f"trl_entropy_{arm}_") as tmp:
        result = Path(tmp) / "entropy.json"
        cmd = [sys.executable, __file__, "--worker", arm, "--steps", str(steps), "--result", str(result)]
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{arm} failed:\n{proc.stderr[-3000:]}")
        return json.loads(result.read_text())


def plot(curves: dict[str, list[float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for arm, values in curves.items():
        ax.plot(range(1, len(values) + 1), values, label=arm, linestyle="--" if arm.startswith("trl") else "-")
    ax.axhline(TARGET, color="grey", linewidth=0.8, label="STARE's target entropy")
    ax.set_xlabel("step")
    ax.set_ylabel("token-mean entropy (nats)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--only", nargs="*", choices=ARMS, default=list(ARMS))
    parser.add_argument("--out", type=Path, default=Path("trl_entropy"))
    parser.add_argument("--worker", choices=ARMS, help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker = trl_worker if args.worker.startswith("trl") else project_worker
        with tempfile.TemporaryDirectory() as tmp:
            Path(args.result).write_text(json.dumps(worker(args.worker, args.steps, Path(tmp))))
        return
    args.out.mkdir(parents=True, exist_ok=True)
    curves = {}
    for arm in args.only:
        curves[arm] = run(arm, args.steps)
        values = curves[arm]
        print(f"{arm}: entropy first {values[0]:.3f}, last {values[-1]:.3f}, min {min(values):.3f}", flush=True)
        (args.out / "entropy.json").write_text(json.dumps(curves, indent=2))
    plot(curves, args.out / "entropy.png")


if __name__ == "__main__":
    main()
