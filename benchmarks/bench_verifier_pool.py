"""What the verifier pool costs over calling the verifiers in-process: one round trip and pickling the batch.

Scores the same batch through a warm ``VerifierPool`` and by calling the verifier directly in this process, takes
the best of ``--repeats`` runs of each and prints both and their difference (the pool's overhead), per batch and
per item. The two must agree item for item.

    python benchmarks/bench_verifier_pool.py                      # 128 countdown checks
    python benchmarks/bench_verifier_pool.py --verifier math --items 64
"""

from __future__ import annotations

import argparse
import time

from stare_lightning.rewards import VerifierPool, get_verifier

COUNTDOWN = {"numbers": [3, 5, 7], "target": 22, "ops": "+-*"}
BATCHES = {
    "countdown": [("countdown", "3*5+7", "22", COUNTDOWN), ("countdown", "3+5+7", "22", COUNTDOWN)],
    "math": [("math", r"\boxed{\frac{1}{2}}", "0.5", {}), ("math", r"\boxed{x^2+2x+1}", "(x+1)^2", {})],
}


def best_of(repeats: int, run) -> tuple[float, list[float]]:
    best, scores = float("inf"), []
    for _ in range(repeats):
        t0 = time.perf_counter()
        scores = run()
        best = min(best, time.perf_counter() - t0)
    return best, scores


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--verifier", choices=sorted(BATCHES), default="countdown")
    parser.add_argument("--items", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    pair = BATCHES[args.verifier]
    items = [pair[k % len(pair)] for k in range(args.items)]
    verify = get_verifier(args.verifier)
    with VerifierPool() as pool:
        pool.score(items)  # start the worker and import the verifier
        pool_s, pooled = best_of(args.repeats, lambda: pool.score(items).scores)
    verify(*items[0][1:])  # the same imports in this process
    direct_s, direct = best_of(args.repeats, lambda: [verify(*item[1:]) for item in items])
    if pooled != direct:
        raise SystemExit(f"the pool and the direct calls disagree: {pooled} vs {direct}")
    overhead = pool_s - direct_s
    print(f"{args.items} {args.verifier} checks, best of {args.repeats}:")
    print(f"  in-process  {direct_s * 1e3:8.2f} ms")
    print(f"  pool        {pool_s * 1e3:8.2f} ms")
    print(f"  overhead    {overhead * 1e3:8.2f} ms per batch, {overhead / args.items * 1e6:.1f} us per item")


if __name__ == "__main__":
    main()
