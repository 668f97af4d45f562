"""What a tool costs a training step: ``experiment=tool_countdown`` with each tool, from real short fits.

Each contender is one ``fit`` process (the cold start is cached after the first), with validation off; the
figures are read from its metrics log and summarised over the steps after the first (which builds the
engine): median step time and its breakdown (rollout generation, tool calls, update), episodes per second
of rollout phase (generation plus tools), tool calls per episode and the mean wall time of one call.

``--refusals`` times instead what the calculator refuses (huge powers and products, deep nesting, over-long
input): each refusal must come back within ``REFUSAL_TARGET_S``, or a policy could stall a step with one call.

    python benchmarks/bench_tools.py                          # calculator and python (bubblewrap), vLLM
    python benchmarks/bench_tools.py --steps 8 --rollout hf --tools calculator
    python benchmarks/bench_tools.py --refusals               # seconds, no fit
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
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
REFUSAL_TARGET_S = 0.2
# What the calculator refuses after some work: bounds on digits, exponents and the parser's nesting.
COSTLY_REFUSALS = ["2 ** 10 ** 10", "9 ** 9 ** 9", "10 ** 5000", "(10 ** 600) * (10 ** 600)", "1e100000000", "1 / 0",
                   "(" * 300 + "1" + ")" * 300, "1" + "+1" * 600, "-" * 990 + "1" + " ** 10 ** 10"]  # fmt: skip


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


def time_refusals(repeats: int) -> dict[str, float]:
    """Expression -> the slowest of ``repeats`` refusals, in seconds (each must be a refusal)."""
    from stare_lightning.tools.calculator import Calculator

    calculator, slowest = Calculator(), {}
    for expression in COSTLY_REFUSALS:
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            result = calculator.run(expression)
            times.append(time.perf_counter() - started)
            if result.ok:
                raise RuntimeError(f"the calculator accepted {expression[:40]!r}: not a refusal to time")
        slowest[expression] = max(times)
    return slowest


def report_refusals(repeats: int) -> None:
    slowest = time_refusals(repeats)
    print(f"| expression | slowest of {repeats} (ms) | within {REFUSAL_TARGET_S} s |\n|---|---|---|")
    for expression, seconds in slowest.items():
        shown = expression if len(expression) <= 40 else expression[:37] + "..."
        print(f"| `{shown}` | {seconds * 1000:.2f} | {'yes' if seconds < REFUSAL_TARGET_S else 'NO'} |")
    if max(slowest.values()) >= REFUSAL_TARGET_S:
        sys.exit(f"a refusal took {max(slowest.values()):.3f} s, over the {REFUSAL_TARGET_S} s target")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tools", nargs="+", default=["calculator", "python"])
    parser.add_argument("--rollout", default="vllm", choices=["vllm", "hf"])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--prompts", type=int, default=16, help="prompts per step (x rollout.n = 8 episodes each)")
    parser.add_argument("--json", type=Path, help="write the results here too")
    parser.add_argument("--refusals", action="store_true", help="time the calculator's refusals instead (no fit)")
    parser.add_argument("--repeats", type=int, default=20, help="with --refusals: runs of each expression")
    args = parser.parse_args()
    if args.refusals:
        report_refusals(args.repeats)
        return
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
