"""Throughput of ``python -m stare_lightning evaluate`` on SmolLM2-135M-Instruct: generated tokens per second.

Writes two small benchmarks of two-number additions ("What is a + b? ... \\boxed{}", the ``math`` verifier),
one sampled n = 8 times and one n = 4 times with at most ``--max-new-tokens`` tokens, evaluates SmolLM2 on
them through the real command (vLLM where installed, else HF ``generate``), and reports the wall time of
the command, the generated tokens (from ``samples.jsonl``) and tokens per second, plus the results table.

    python benchmarks/bench_evaluate.py                       # vLLM where installed
    python benchmarks/bench_evaluate.py --rollout hf --problems 8
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SUFFIX = "Please reason step by step, and put your final answer within \\boxed{}."


def write_benchmark(path: Path, problems: int, seed: int) -> None:
    rng = random.Random(seed)
    with path.open("w") as handle:
        for i in range(problems):
            a, b = rng.randint(10, 99), rng.randint(10, 99)
            message = {"role": "user", "content": f"What is {a} + {b}? {SUFFIX}"}
            record = {"id": f"{path.stem}-{i}", "messages": [message], "answer": str(a + b), "verifier": "math"}
            handle.write(json.dumps(record) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--problems", type=int, default=16, help="problems per benchmark")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--rollout", default="auto", choices=["auto", "vllm", "hf"])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        files = [tmp / "sums_a.jsonl", tmp / "sums_b.jsonl"]
        for seed, path in enumerate(files):
            write_benchmark(path, args.problems, seed)
        command = [
            sys.executable, "-m", "stare_lightning", "evaluate", "model=smollm2", "data.prompt_style=instruct",
            "data.max_prompt_length=256", f"data.val_files=[{files[0]},{files[1]}]", "rollout.val_n=8",
            "data.val_sets=[{name: sums_b, n: 4}]", f"rollout.max_new_tokens={args.max_new_tokens}",
            f"rollout={args.rollout}", "validation.pass_k=[1,4]", f"output_dir={tmp / 'eval'}",
        ]  # fmt: skip
        start = time.perf_counter()
        subprocess.run(command, cwd=REPO, check=True, stdout=subprocess.DEVNULL)
        seconds = time.perf_counter() - start
        samples = [json.loads(line) for line in (tmp / "eval" / "samples.jsonl").read_text().splitlines()]
        tokens = sum(s["length"] for s in samples)
        print(f"rollout={args.rollout}: {len(samples)} samples, {tokens} generated tokens in {seconds:.1f} s "
              f"(whole command, model loading included): {tokens / seconds:.1f} tokens/s")  # fmt: skip
        print((tmp / "eval" / "results.md").read_text())


if __name__ == "__main__":
    main()
