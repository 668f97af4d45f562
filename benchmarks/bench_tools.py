"""What a tool costs a training step: ``experiment=tool_countdown`` with each tool, from real short fits.

Each contender is one ``fit`` process (the cold start is cached after the first), with validation off; the
figures are read from its metrics log and summarised over the steps after the first (which builds the
engine): median step time and its breakdown (rollout generation, tool calls, update), episodes per second
of rollout phase (generation plus tools), tool calls per episode and the mean wall time of one call.

    python benchmarks/bench_tools.py                          # calculator and python (bubblewrap), vLLM
    python benchmarks/bench_tools.py --steps 8 --rollout hf --tools calculator
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_fit(tool: str, rollout: str, steps: int, out_dir: Path, extra: list[str]) -> list[dict[str, float]]:
    args = [sys.executable, "-m", "stare_lightning", "fit", "experiment=tool_countdown", f"tools={tool}",
            f"rollout={rollout}", f"trainer.max_steps={steps}", "validation.before_fit=false",
            "trainer.val_check_interval=1000", "summary=false", f"output_dir={out_dir}", *extra]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    done = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"fit with tools={tool} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    with open(out_dir / "logs" / "metrics.csv") as handle:
        rows = [{k: float(v) for k, v in r.items() if v != ""} for r in csv.DictReader(handle)]
    return [r for r in rows if "train/time/step_s" in r]


def summarise(rows: list[dict[str, float]], episodes_per_step: int) -> dict[str, float]:
    timed = rows[1:] or rows

    def median(key: str) -> float:
        return statistics.median(r[f"train/{key}"] for r in timed)

    rollout_phase = median("time/rollout") + median("time/tool")
    return {
        "step_s": median("time/step_s"),
        "rollout_s": median("time/rollout"),
        "tool_s": median("time/tool"),
        "update_s": median("time/update"),
        "episodes_per_s": episodes_per_step / rollout_phase if rollout_phase > 0 else float("nan"),
        "calls_per_episode": median("tool/calls_per_episode"),
        "seconds_per_call": median("tool/seconds"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tools", nargs="+", default=["calculator", "python"])
    parser.add_argument("--rollout", default="vllm", choices=["vllm", "hf"])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--prompts", type=int, default=16, help="prompts per step (x rollout.n = 8 episodes each)")
    parser.add_argument("--json", type=Path, help="write the results here too")
    args = parser.parse_args()
    results = {}
    for tool in args.tools:
        with tempfile.TemporaryDirectory(prefix=f"bench_tools_{tool}_") as tmp:
            rows = run_fit(tool, args.rollout, args.steps, Path(tmp), [f"data.prompts_per_step={args.prompts}"])
        results[tool] = summarise(rows, episodes_per_step=args.prompts * 8)
        print(f"[{tool}] " + ", ".join(f"{k} {v:.3f}" for k, v in results[tool].items()), flush=True)
    keys = list(next(iter(results.values())))
    print("\n| tool | " + " | ".join(keys) + " |\n|---|" + "---|" * len(keys))
    for tool, values in results.items():
        print(f"| {tool} | " + " | ".join(f"{values[k]:.3f}" for k in keys) + " |")
    if args.json:
        args.json.write_text(json.dumps({"rollout": args.rollout, "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
