"""Per-benchmark evaluation: the report's numbers against naive recomputations, majority voting through the
verifiers, and the ``evaluate`` command on the tiny model (two benchmarks with different n, one and two
ranks, resuming)."""

from __future__ import annotations

import json
import math
from itertools import groupby
from pathlib import Path

import pytest

from stare_lightning.evaluation import benchmark_results, markdown_table
from stare_lightning.metrics import PassAtK
from stare_lightning.rewards import VerifierPool
from stare_lightning.rewards.majority import answer_key, majority_correct, winning_vote
from tests.test_fit import FAST, read_metrics, run_cli


def naive_pass_at_k(n: int, c: int, k: int) -> float:
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def _samples(scores: dict[str, list[float]], majority: dict[str, bool]) -> list[dict]:
    return [
        {
            "benchmark": "b",
            "id": pid,
            "sample": j,
            "score": s,
            "majority": majority[pid],
            "length": 3 + j,
            "truncated": j == 0,
        }
        for pid, row in scores.items()
        for j, s in enumerate(row)
    ]


@pytest.mark.parametrize("n, c, k", [(4, 0, 1), (4, 1, 2), (8, 3, 4), (32, 5, 16), (5, 5, 5), (32, 1, 32)])
def test_pass_at_k_equals_the_binomial_form(n, c, k):
    """One problem, ``c`` of ``n`` samples correct: the report's pass@k against 1 - C(n - c, k) / C(n, k)."""
    got = benchmark_results(_samples({"p": [1] * c + [0] * (n - c)}, {"p": False}), pass_k=[k])
    assert got[f"pass@{k}"] == pytest.approx(naive_pass_at_k(n, c, k), abs=1e-12)


def test_the_report_and_the_logged_metric_give_the_same_pass_at_k():
    """``evaluate``'s results.json and the ``val/pass@k`` a fit logs, on the same problems, to the last bit."""
    import torch

    correct = {"p1": 0, "p2": 3, "p3": 7, "p4": 8, "p5": 1}
    scores = {pid: [1] * c + [0] * (8 - c) for pid, c in correct.items()}
    report = benchmark_results(_samples(scores, dict.fromkeys(scores, False)), pass_k=[1, 2, 5, 8, 16])
    metric = PassAtK(k=[1, 2, 5, 8])
    metric.update(torch.tensor(list(correct.values())), 8)
    logged = {key: float(value) for key, value in metric.compute().items()}
    assert {key: report[key] for key in logged} == logged
    assert "pass@16" not in report  # k above n: left out


def test_benchmark_results_match_a_hand_computation():
    scores = {"p1": [1, 0, 0, 1], "p2": [0, 0, 0, 0], "p3": [1, 1, 1, 0]}
    got = benchmark_results(_samples(scores, {"p1": True, "p2": False, "p3": True}), pass_k=[1, 2, 8])
    shares = [0.5, 0.0, 0.75]
    mean = sum(shares) / 3
    half = 1.96 * math.sqrt(sum((x - mean) ** 2 for x in shares) / 2) / math.sqrt(3)
    assert got["n"] == 4 and got["num_problems"] == 3
    assert got["avg@4"] == pytest.approx(mean) and got["avg@4_ci95"] == pytest.approx([mean - half, mean + half])
    assert got["pass@2"] == pytest.approx(sum(naive_pass_at_k(4, c, 2) for c in (2, 0, 3)) / 3)
    assert "pass@8" not in got  # k > n is not estimable
    assert got["maj@4"] == pytest.approx(2 / 3) and got["truncated_frac"] == pytest.approx(0.25)
    assert "| b | 3 | 4 |" in markdown_table({"b": got})


def test_winning_vote_counts_members_and_breaks_ties_by_first_appearance():
    same = lambda a, b: a == b  # noqa: E731
    assert winning_vote(["7", "8", "8", "7", None], same) == 0  # a tie of two: the earlier vote wins
    assert winning_vote(["7", "8", "8"], same) == 1
    assert winning_vote([None, None], same) is None
    assert answer_key("so \\boxed{ 42 }") == "42" and answer_key("Answer: The Cat") == "the cat"


def test_majority_uses_math_equivalence_through_the_pool():
    items = [
        {"verifier": "math", "answer": "1/2", "metadata": {}},
        {"verifier": "exact", "answer": "b", "metadata": {}},
    ]
    texts = ["\\boxed{0.5}", "\\boxed{\\frac{1}{2}}", "\\boxed{3}", "b", "a", "a"]
    scores = [1.0, 1.0, 0.0, 1.0, 0.0, 0.0]
    with VerifierPool() as pool:
        votes = majority_correct(items, texts, scores, 3, pool)
    # 0.5 and 1/2 are one vote of two (correct); "a" outvotes "b" under string comparison (wrong).
    assert votes == [True, False]


# ------------------------------------------------------------------------------------ the command


def _write_benchmarks(directory: Path) -> list[Path]:
    from stare_lightning.data import build_records

    records = build_records("countdown", "val", 0, val_size=10, seed=77)
    paths = []
    for name, part in (("bench_a", records[:6]), ("bench_b", records[6:])):
        path = directory / f"{name}.jsonl"
        with path.open("w") as handle:
            for r in part:
                handle.write(json.dumps({"id": r.id, "prompt": r.prompt, "answer": r.answer, "verifier": r.verifier,
                                         "metadata": r.metadata}) + "\n")  # fmt: skip
        paths.append(path)
    return paths


def _evaluate(out: Path, files: list[Path], model_cache, extra=(), n_b=2):
    val_files = f"data.val_files=[{','.join(map(str, files))}]"
    val_sets = f"data.val_sets=[{{name: bench_b, n: {n_b}}}]"
    args = ["evaluate", f"output_dir={out}", *FAST, val_files, "rollout.val_n=4", val_sets, "validation.pass_k=[1,2,4]"]
    proc = run_cli([*args, *extra], model_cache, cwd=out.parent)
    log, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, log[-4000:]
    results = json.loads((out / "results.json").read_text())
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    return results, samples, log


@pytest.mark.slow
def test_evaluate_two_benchmarks_one_and_two_ranks_and_resume(tmp_path, model_cache):
    files = _write_benchmarks(tmp_path)
    results, samples, _ = _evaluate(tmp_path / "one", files, model_cache)
    assert set(results) == {"bench_a", "bench_b", "average"}
    for name, n, problems in (("bench_a", 4, 6), ("bench_b", 2, 4)):
        mine = [s for s in samples if s["benchmark"] == name]
        assert results[name]["n"] == n and results[name]["num_problems"] == problems and len(mine) == n * problems
        assert results[name][f"avg@{n}"] == pytest.approx(sum(s["score"] for s in mine) / len(mine))
        by_problem = [list(g) for _, g in groupby(mine, key=lambda s: s["id"])]
        for k in (1, 2, 4):
            if k <= n:
                want = sum(naive_pass_at_k(n, sum(s["score"] > 0.5 for s in p), k) for p in by_problem) / problems
                assert results[name][f"pass@{k}"] == pytest.approx(want)
        # maj@n from the JSONL: the most common non-empty response (ties: the first), scored by its first sample
        votes = []
        for p in by_problem:
            keys = [s["response"].strip().lower() or None for s in p]
            voting = [key for key in dict.fromkeys(keys) if key is not None]
            best = max(voting, key=lambda key: (keys.count(key), -keys.index(key))) if voting else None
            votes.append(best is not None and p[keys.index(best)]["score"] > 0.5)
        assert results[name][f"maj@{n}"] == pytest.approx(sum(votes) / problems)
    assert results["average"]["avg@n"] == pytest.approx((results["bench_a"]["avg@4"] + results["bench_b"]["avg@2"]) / 2)

    two, two_samples, _ = _evaluate(tmp_path / "two", files, model_cache, ["trainer=ddp", "trainer.accelerator=cpu",
                                                                          "trainer.devices=2"])  # fmt: skip
    assert two_samples == samples and two == results

    # Resume: the same directory keeps both benchmarks; a new n for bench_b re-evaluates only bench_b.
    again, _, log = _evaluate(tmp_path / "one", files, model_cache)
    assert again == results and "keeping the results of ['bench_a', 'bench_b']" in log
    _, _, log = _evaluate(tmp_path / "one", files, model_cache, n_b=3)
    assert "keeping the results of ['bench_a']" in log


@pytest.mark.slow
def test_fit_logs_each_benchmark_and_stops_early_on_one(tmp_path, model_cache):
    files = _write_benchmarks(tmp_path)
    monitor = "val/bench_a/avg@4"
    val_files = f"data.val_files=[{','.join(map(str, files))}]"
    args = [
        "fit", f"output_dir={tmp_path / 'run'}", *FAST, val_files, "rollout.val_n=4",
        "data.val_sets=[{name: bench_b, n: 2}]", "callbacks=early_stopping", "callbacks.rich_progress_bar=null",
        f"callbacks.early_stopping.monitor={monitor}", "callbacks.early_stopping.patience=1",
        "callbacks.early_stopping.min_delta=1.0", "trainer.val_check_interval=1", "trainer.max_steps=20",
        "validation.before_fit=false",
    ]  # fmt: skip
    proc = run_cli(args, model_cache, cwd=tmp_path)
    log, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, log[-4000:]
    rows = read_metrics(tmp_path / "run")
    logged = set().union(*rows)
    assert {monitor, "val/bench_b/avg@2", "val/bench_b/maj@2", "val/bench_a/pass@2", "val/avg"} <= logged
    steps = [r["step"] for r in rows if "train/entropy" in r]
    # An improvement of 1.0 in avg@4 is impossible: the first check sets the best, the next one stops the run.
    assert len(steps) == 2, steps
