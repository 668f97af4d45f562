"""Peak memory and speed of the training forward/backward on long responses: today's padded path that holds the
logits against padding-free packed micro-batches with the fused LM head.

A step's batch of three rows with forced lengths after a 64-token prompt: responses of L, L / 4 and L / 8 tokens,
split into micro-batches of at most L + 64 tokens as the trainer splits them (``forward.micro_batch_tokens`` is at
least one response in the long-CoT recipes): the long row alone, the two short ones together (padded to the
longer of them, or packed). The loss is the token-mean log-prob of the sampled tokens plus 0.01 x entropy, what
the policy loss backpropagates through, accumulated over the micro-batches; gradient checkpointing is on (the
long-CoT recipes' setting) and the model is fp32. Each configuration runs in a fresh process: its peak is
the growth of the process's peak resident memory over its resident memory right before the step (weights and
gradients' storage allocated beforehand), on GPUs ``torch.cuda.max_memory_allocated`` over the allocation then.

    python benchmarks/bench_long_responses.py                            # tiny and SmolLM2, L = 2k, 4k, 8k
    python benchmarks/bench_long_responses.py --models tiny --lengths 2048 4096 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

LAYOUTS = {"padded_logits": (False, False), "packed_fused": (True, True)}
PROMPT = 64


MODELS = {"tiny": "tiny", "smollm2": "smollm2-135m-instruct"}


def _model_dir(name: str) -> Path:
    from stare_lightning.models.registry import resolve_model

    return Path(resolve_model(MODELS[name]))


def _batch(vocab: int, length: int):
    import torch

    from stare_lightning.rollout.base import Rollouts
    from stare_lightning.step import Experience
    from stare_lightning.step.batch import build_rollout_batch

    g = torch.Generator().manual_seed(0)
    lengths = (length, length // 4, length // 8)
    responses = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]
    rollouts = Rollouts(
        prompt_ids=[torch.randint(3, vocab, (PROMPT,), generator=g).tolist() for _ in lengths],
        response_ids=responses,
        response_logprobs=[[-1.0] * n for n in lengths],
        texts=[""] * 3,
        finish_reasons=["length"] * 3,
        n=3,
    )
    advantages = torch.tensor([1.0, -1.0, 0.5])
    batch = build_rollout_batch(rollouts, advantages, advantages, pad_token_id=0)
    return Experience.build(batch, old_logprobs=None, phi=None, stare_weights=None, stare_selected=None)


def _resident_bytes() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def worker(model: str, layout_name: str, length: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from stare_lightning.step import micro_batches
    from stare_lightning.step.forward import ForwardLayout, response_token_stats

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    policy = AutoModelForCausalLM.from_pretrained(_model_dir(model), dtype=torch.float32).to(device)
    policy.gradient_checkpointing_enable()
    policy.train()
    for param in policy.parameters():  # gradients' storage exists before the measured step, as after step 1
        param.grad = torch.zeros_like(param)
    packed, fused = LAYOUTS[layout_name]
    layout = ForwardLayout(packed=packed, fused_head=fused)
    batch = _batch(policy.config.vocab_size, length).to(device)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    else:
        before = _resident_bytes()
    started = time.perf_counter()
    loss, computed = 0.0, 0
    for part in micro_batches(batch, length + PROMPT, packed=packed):
        stats = response_token_stats(policy, part, layout, temperature=1.0, chunk_size=1024)
        mask = part.response_mask
        part_loss = -((stats.logprobs + 0.01 * stats.entropy) * mask).sum() / batch.response_mask.sum()
        part_loss.backward()
        loss += float(part_loss)
        computed += int(part.attention_mask.sum()) if packed else part.attention_mask.numel()
    if cuda:
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    seconds = time.perf_counter() - started
    tokens = int(batch.attention_mask.sum())
    return {
        "model": model,
        "layout": layout_name,
        "response_tokens": length,
        "tokens": tokens,
        "computed_tokens": computed,  # padding included
        "vocab": policy.config.vocab_size,
        "peak_mib": peak / 2**20,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "loss": loss,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=["tiny", "smollm2"], choices=list(MODELS))
    parser.add_argument("--lengths", nargs="*", type=int, default=[2048, 4096, 8192])
    parser.add_argument("--layouts", nargs="*", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--json")
    parser.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        model, layout, length = args.worker
        print(json.dumps(worker(model, layout, int(length))))
        return
    rows = []
    print("| model | response tokens | layout | peak MiB | s | tokens/s | loss |\n|---|---|---|---|---|---|---|")
    for model in args.models:
        for length in args.lengths:
            for layout in args.layouts:
                cmd = [sys.executable, __file__, "--worker", model, layout, str(length)]
                proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
                if proc.returncode != 0:
                    raise RuntimeError(f"{model} {layout} {length} failed:\n{proc.stderr[-3000:]}")
                row = json.loads(proc.stdout.strip().splitlines()[-1])
                rows.append(row)
                print(f"| {model} | {length} | {layout} | {row['peak_mib']:.0f} | {row['seconds']:.1f} | "
                      f"{row['tokens_per_s']:.0f} | {row['loss']:.5f} |", flush=True)  # fmt: skip
                if args.json:
                    Path(args.json).write_text(json.dumps(rows, indent=2))
    for model in args.models:  # growth of the peak per extra response token between the shortest and longest
        for layout in LAYOUTS:
            mine = sorted((r for r in rows if r["model"] == model and r["layout"] == layout),
                          key=lambda r: r["response_tokens"])  # fmt: skip
            if len(mine) >= 2:
                first, last = mine[0], mine[-1]
                slope = (last["peak_mib"] - first["peak_mib"]) / (last["tokens"] - first["tokens"]) * 1024
                print(f"{model} {layout}: {slope:.1f} KiB of peak per token from {first['response_tokens']} to "
                      f"{last['response_tokens']} response tokens")  # fmt: skip


if __name__ == "__main__":
    main()
