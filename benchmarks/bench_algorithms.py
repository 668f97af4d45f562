"""Benchmarks of `stare_lightning.algorithms`: the chunked logits pass against a naive one, and STARE's cost.

1. Per-token statistics (log-prob of the target, entropy, sum pi^2, sum pi^2 log pi) from logits
   [B, T, V], forward + backward (gradients through log-probs and entropy), chunked
   (`token_stats_from_logits`, chunk 1024 rows) versus naive (log_softmax over the full [N, V] in
   float32, then exp, the entropy product and the sums, under plain autograd).
2. STARE weights (scope "step") as a share of one loss computation: the chunked statistics pass
   plus `policy_loss`, forward + backward.

How memory is measured: torch's CPU tensors are plain malloc'd memory, invisible to tracemalloc, and
torch.cuda's counters do not exist here. Each variant therefore runs in a FRESH subprocess that
allocates its inputs (logits, targets) first, resets the kernel's peak-RSS counter (writing "5" to
/proc/self/clear_refs resets VmHWM to the current RSS), runs the work, and reads VmHWM back. Large
torch buffers are mmap'd by glibc and returned to the kernel when freed, and every buffer here is
written, so peak RSS minus the RSS before the work is the peak of extra live memory. Both variants
also produce logits.grad (same shape and dtype as the logits): it is reported separately, since no
method can avoid it. Times are the best of `--repeats` runs on `--threads` CPU threads.

Run: python benchmarks/bench_algorithms.py [--vocab 49152 151936] [--batch 8] [--seq 1024]
When the naive pass would not fit in the memory available it is run on fewer tokens (halving the
sequence length) and its extra memory is also given scaled linearly to the full token count.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

MIB = 1024 * 1024


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{key} not in /proc/self/status")


def _rss_bytes() -> int:
    return _status_kib("VmRSS") * 1024


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def _peak_bytes(reset_ok: bool) -> int:
    if reset_ok:
        return _status_kib("VmHWM") * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _mem_available() -> int:
    with open("/proc/meminfo") as fh:
        for line in fh:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


# ------------------------------------------------------------------ worker side


def _naive_stats(logits, targets):
    import torch

    logp = torch.log_softmax(logits.float(), dim=-1)
    lp = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    p = logp.exp()
    ent = -(p * logp).sum(-1)
    with torch.no_grad():
        p2 = p * p
        s2 = p2.sum(-1)
        s2l = (p2 * logp).sum(-1)
    return lp, ent, s2, s2l


def _worker_stats(args) -> dict:
    import torch

    from stare_lightning.algorithms import token_stats_from_logits

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    B, T, V = args.batch, args.seq, args.vocab
    logits = torch.empty(B, T, V, dtype=dtype).normal_(0.0, 2.0).requires_grad_()
    targets = torch.randint(0, V, (B, T))
    w_lp, w_ent = torch.randn(B, T), torch.randn(B, T)
    base = _rss_bytes()
    reset_ok = _reset_peak()
    times = []
    for _ in range(args.repeats):
        logits.grad = None
        t0 = time.perf_counter()
        if args.worker == "naive":
            lp, ent, _, _ = _naive_stats(logits, targets)
        else:
            st = token_stats_from_logits(logits, targets, chunk_size=args.chunk, with_sensitivity=True)
            lp, ent = st.logprobs, st.entropy
        ((lp * w_lp).sum() + (ent * w_ent).sum()).backward()
        times.append(time.perf_counter() - t0)
        del lp, ent
    peak = _peak_bytes(reset_ok)
    return {
        "variant": args.worker,
        "vocab": V,
        "tokens": B * T,
        "dtype": args.dtype,
        "input_mib": logits.numel() * logits.element_size() / MIB,
        "grad_mib": logits.grad.numel() * logits.grad.element_size() / MIB,
        "extra_peak_mib": (peak - base) / MIB,
        "time_s": min(times),
        "peak_reset": reset_ok,
    }


def _worker_stare(args) -> dict:
    import torch

    from stare_lightning.algorithms import (
        AlgorithmConfig,
        LossNormalizer,
        LossSpec,
        STARERule,
        policy_loss,
        stare_weights_for_scope,
        token_stats_from_logits,
    )

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    B, T, V = args.batch, args.seq, args.vocab
    lengths = torch.randint(T // 4, T + 1, (B,))
    mask = torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)
    adv = torch.randn(B)
    logits = torch.empty(B, T, V, dtype=getattr(torch, args.dtype)).normal_(0.0, 2.0).requires_grad_()
    targets = torch.randint(0, V, (B, T))
    old = token_stats_from_logits(logits.detach(), targets, chunk_size=args.chunk, with_entropy=False).logprobs
    cfg = AlgorithmConfig(policy_loss={"clip_eps_high": 0.28, "dual_clip_c": 10.0})
    norm = LossNormalizer.from_mask(mask)

    def stare():
        rule = STARERule.of(variant="C2", top_ratio=0.1)
        return stare_weights_for_scope([old], [adv], [mask], scope="step", rule=rule)[0][0]

    def loss_only(weights):
        lp = old.clone().requires_grad_()
        loss, _ = policy_loss(lp, old, adv, mask, LossSpec.of(cfg), norm, token_weights=weights)
        loss.backward()

    def full_loss(weights):
        logits.grad = None
        st = token_stats_from_logits(logits, targets, chunk_size=args.chunk)
        loss, _ = policy_loss(st.logprobs, old, adv, mask, LossSpec.of(cfg), norm, token_weights=weights)
        loss.backward()

    def timed(fn, n):
        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
        return statistics.median(out)

    weights = stare()
    t_stare = timed(stare, 30)
    t_policy = timed(lambda: loss_only(weights), 30)
    t_full = timed(lambda: full_loss(weights), args.repeats)
    return {
        "variant": "stare",
        "vocab": V,
        "tokens": B * T,
        "valid_tokens": int(mask.sum()),
        "stare_ms": t_stare * 1e3,
        "policy_loss_ms": t_policy * 1e3,
        "full_loss_s": t_full,
        "share_of_full_loss": t_stare / t_full,
        "share_of_policy_loss_only": t_stare / t_policy,
    }


# ------------------------------------------------------------------ driver side


def _run_worker(variant: str, vocab: int, seq: int, args) -> dict:
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--worker",
        variant,
        "--vocab",
        str(vocab),
        "--batch",
        str(args.batch),
        "--seq",
        str(seq),
        "--chunk",
        str(args.chunk),
        "--dtype",
        args.dtype,
        "--threads",
        str(args.threads),
        "--repeats",
        str(args.repeats),
    ]
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"benchmark worker {variant} (vocab {vocab}) failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _naive_bytes(tokens: int, vocab: int, elem: int) -> int:
    # input + grad in the logits dtype, and about four float32 [N, V] buffers alive at the peak
    return tokens * vocab * (2 * elem + 4 * 4)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--vocab", type=int, nargs="+", default=[49152, 151936])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument(
        "--mem-fraction",
        type=float,
        default=0.6,
        help="largest share of MemAvailable a naive run may need before it is run on fewer tokens",
    )
    args = ap.parse_args()

    if args.worker is not None:
        args.vocab = args.vocab[0]
        result = _worker_stare(args) if args.worker == "stare" else _worker_stats(args)
        print(json.dumps(result))
        return

    elem = {"bfloat16": 2, "float16": 2, "float32": 4}[args.dtype]
    full_tokens = args.batch * args.seq
    print(
        f"# {args.batch} x {args.seq} tokens, logits {args.dtype}, chunk {args.chunk}, "
        f"{args.threads} thread(s), forward + backward through log-probs and entropy"
    )
    print(
        f"{'vocab':>7} {'variant':>8} {'tokens':>6} {'logits MiB':>10} {'grad MiB':>9} "
        f"{'extra peak MiB':>14} {'extra - grad':>12} {'time s':>7}"
    )
    chunked_times = {}
    for vocab in args.vocab:
        for variant in ("naive", "chunked"):
            seq = args.seq
            if variant == "naive":
                while seq > 1 and _naive_bytes(args.batch * seq, vocab, elem) > args.mem_fraction * _mem_available():
                    seq //= 2
            r = _run_worker(variant, vocab, seq, args)
            scale = full_tokens / r["tokens"]
            extra_wo_grad = r["extra_peak_mib"] - r["grad_mib"]
            note = (
                ""
                if scale == 1
                else (
                    f"  (scaled to {full_tokens} tokens: extra - grad ~ "
                    f"{extra_wo_grad * scale:,.0f} MiB; did not fit here)"
                )
            )
            print(
                f"{vocab:>7} {variant:>8} {r['tokens']:>6} {r['input_mib']:>10,.0f} {r['grad_mib']:>9,.0f} "
                f"{r['extra_peak_mib']:>14,.0f} {extra_wo_grad:>12,.0f} {r['time_s']:>7.2f}{note}"
            )
            r["extra_wo_grad_full_mib"] = extra_wo_grad * scale
            r["time_full_s"] = r["time_s"] * scale
            if variant == "naive":
                naive = r
            else:
                chunked_times[vocab] = r["time_s"]
                ratio = naive["extra_wo_grad_full_mib"] / max(extra_wo_grad, 1e-9)
                print(
                    f"{'':>7} -> working memory (extra - grad) naive / chunked = {ratio:.1f}x; "
                    f"time chunked / naive = {r['time_s'] / naive['time_full_s']:.2f}"
                    + ("" if naive["tokens"] == full_tokens else " (naive time scaled linearly)")
                )
    print()
    print(
        "# STARE weights (scope step, C2, P=0.1) against one loss computation "
        "(chunked statistics + policy_loss, forward + backward)"
    )
    for vocab in args.vocab:
        r = _run_worker("stare", vocab, args.seq, args)
        print(
            f"vocab {vocab}: {r['valid_tokens']} valid of {r['tokens']} tokens; STARE {r['stare_ms']:.2f} ms, "
            f"full loss {r['full_loss_s']:.2f} s -> {100 * r['share_of_full_loss']:.3f}% of the loss; "
            f"policy_loss alone {r['policy_loss_ms']:.2f} ms"
        )


if __name__ == "__main__":
    main()
