"""Benchmark results from the evaluated samples: avg@n, pass@k, maj@n, a 95% interval, and a Markdown table.

Everything here is computed from the sample records that ``evaluate`` writes to ``samples.jsonl`` (one per
sample: ``benchmark``, ``id``, ``sample``, ``score``, ``majority``, ``length``, ``truncated``), so a reader
can recompute every number from that file. A sample is correct when its score is above 0.5.
- avg@n: the mean over problems of the share of correct samples (the paper's avg@n, pass@1 estimated
  from n samples); its 95% interval uses the normal approximation over problems: mean +- 1.96 s / sqrt(P),
  with s the sample standard deviation of the per-problem shares (0 width for a single problem).
- pass@k: the unbiased estimator 1 - C(n - c, k) / C(n, k), averaged over problems, for k <= n; computed by
  the function the logged ``val/pass@k`` metric uses (``metrics.functional``), so the two cannot disagree.
- maj@n: the share of problems whose majority vote is correct (``rewards.majority``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from itertools import groupby

import torch

# The torchmetrics-style update of the PassAtK metric: per problem n and c in, the sum of pass@k over problems out.
from stare_lightning.metrics.functional import _pass_at_k_update


def benchmark_results(samples: Sequence[dict], pass_k: Sequence[int]) -> dict:
    """The results of one benchmark's samples (all with the same number of samples per problem)."""
    samples = sorted(samples, key=lambda s: (str(s["id"]), s["sample"]))
    problems = [list(group) for _, group in groupby(samples, key=lambda s: str(s["id"]))]
    n = len(problems[0])
    if any(len(p) != n for p in problems):
        raise ValueError(f"benchmark {samples[0]['benchmark']!r}: problems have different numbers of samples")
    correct = [sum(s["score"] > 0.5 for s in p) for p in problems]
    shares = [c / n for c in correct]
    mean = sum(shares) / len(shares)
    spread = math.sqrt(sum((x - mean) ** 2 for x in shares) / (len(shares) - 1)) if len(shares) > 1 else 0.0
    half_width = 1.96 * spread / math.sqrt(len(shares))
    out = {
        "n": n,
        "num_problems": len(problems),
        f"avg@{n}": mean,
        f"avg@{n}_ci95": [mean - half_width, mean + half_width],
    }
    ks = [k for k in pass_k if k <= n]
    sums, _ = _pass_at_k_update(n, torch.tensor(correct), ks)
    for k, total in zip(ks, sums.tolist()):
        out[f"pass@{k}"] = total / len(correct)
    out[f"maj@{n}"] = sum(bool(p[0]["majority"]) for p in problems) / len(problems)
    out["response_length/mean"] = sum(s["length"] for s in samples) / len(samples)
    out["truncated_frac"] = sum(bool(s["truncated"]) for s in samples) / len(samples)
    return out


def all_results(samples: Iterable[dict], pass_k: Sequence[int], order: Sequence[str]) -> dict:
    """``{benchmark: results, ..., "average": ...}`` over the benchmarks named in ``order``."""
    by_benchmark: dict[str, list[dict]] = {}
    for sample in samples:
        by_benchmark.setdefault(sample["benchmark"], []).append(sample)
    results = {name: benchmark_results(by_benchmark[name], pass_k) for name in order if name in by_benchmark}
    results["average"] = average(results)
    return results


def average(results: dict) -> dict:
    """The mean over benchmarks of avg@n, maj@n and every pass@k that all of them report (the paper's Avg)."""
    rows = [r for name, r in results.items() if name != "average"]
    if not rows:
        return {}
    out = {
        "num_benchmarks": len(rows),
        "avg@n": sum(r[f"avg@{r['n']}"] for r in rows) / len(rows),
        "maj@n": sum(r[f"maj@{r['n']}"] for r in rows) / len(rows),
    }
    shared = set.intersection(*({k for k in r if k.startswith("pass@")} for r in rows))
    for key in sorted(shared, key=lambda k: int(k.split("@")[1])):
        out[key] = sum(r[key] for r in rows) / len(rows)
    return out


def markdown_table(results: dict) -> str:
    """One row per benchmark and the average: problems, n, avg@n with its 95% interval, maj@n, pass@k."""
    rows = [(name, r) for name, r in results.items() if name != "average"]
    ks = sorted({k for _, r in rows for k in r if k.startswith("pass@")}, key=lambda k: int(k.split("@")[1]))
    lines = ["| benchmark | problems | n | avg@n (95% CI) | maj@n | " + " | ".join(ks) + " |"]
    lines.append("|" + "---|" * (5 + len(ks)))
    for name, r in rows:
        n = r["n"]
        low, high = r[f"avg@{n}_ci95"]
        cells = [name, str(r["num_problems"]), str(n), f"{r[f'avg@{n}']:.3f} ({low:.3f}-{high:.3f})"]
        cells += [f"{r[f'maj@{n}']:.3f}"] + [f"{r[k]:.3f}" if k in r else "-" for k in ks]
        lines.append("| " + " | ".join(cells) + " |")
    avg = results.get("average", {})
    if avg:
        cells = ["average", "", "", f"{avg['avg@n']:.3f}", f"{avg['maj@n']:.3f}"]
        cells += [f"{avg[k]:.3f}" if k in avg else "-" for k in ks]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
