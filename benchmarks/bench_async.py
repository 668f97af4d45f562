"""``rollout.max_staleness=K`` on SmolLM2-135M-Instruct: the training step with K = 0, 1, 2 against the colocated one.

Four arms, each a short fit of ``experiment=smollm2_countdown`` (``--steps`` optimizer steps, the same job for all:
``JOB_OVERRIDES``, or ``SMOKE_OVERRIDES`` on top with ``--smoke``):

(a) ``rollout=server rollout.max_staleness=0``: the synchronous step through the producer (step/producer.py);
(b) ``rollout=server rollout.max_staleness=1``: batch b generated with version b-1 while the trainer updates;
(c) ``rollout=server rollout.max_staleness=2``;
(d) ``rollout=vllm``: the colocated default, trainer and in-process engine on every core this process may use.

(a)-(c) run against ONE stock vLLM server that this benchmark starts (``LaunchedServers``) pinned to
``--engine-cpu``; each such fit runs pinned to ``--trainer-cpu`` with ``OMP_NUM_THREADS=1`` (``rollout.server.launch
=false``, as ``bench_server.py``'s fit). The server stays up, idle, during (d): its CPU seconds during each arm are
reported, so an idle server that took cycles from (d) would show. The arms alternate in rounds (a, b, c, d, then
a, b, c, d again for ``--rounds 2``), so drift in the machine's load hits every arm alike.

Read from each fit's ``logs/metrics.csv``, over the steps after the first ``--warmup`` (2: the first steps warm up,
and with K >= 1 the first K steps sample with staleness < K), pooled over the rounds: the medians of
``train/time/step_s``, ``trainer_idle`` (the trainer's wait for its batch), ``engine_idle`` (the producer's wait for
a version), ``weight_push``, ``async/rollout_s`` (generation + tool + verify of the batch, beside the step; for the
colocated arm its in-step ``rollout + tool + verify``), ``update``, ``sync``, ``score``, the staleness, and the
median per step of trainer_idle / step_s (the fraction of the step the trainer idles). Reported: the step-time
ratios K=1 / K=0 (target: at most ``TARGET_K1``), K=2 / K=0 and colocated / K=0, pooled and per round.

Prediction. With perfect overlap a step takes about max(generation, update + sync + rest) + push, so against the
synchronous step, whose shares are g (generation), p (the push) and 1 - g - p (the trainer's work), the ratio is
about max(g, 1 - g) + p. Printed: that bound with this run's own g and p (max(g, 1 - g - p) + p, to set against the
measured K=1 ratio), and for a GPU cluster where generation is 70% or 80% of the synchronous step, with the push
share p measured here (a CPU's: a cluster's push share depends on its network, model and step, so read these two as
illustrations of the bound). With K >= 1 the push runs in the producer thread, which shares the trainer's core here.

    python benchmarks/bench_async.py                           # 6 steps x 4 arms, 1 round: roughly 25 minutes, 2 cores
    python benchmarks/bench_async.py --rounds 2 --json a.json  # roughly 50 minutes
    python benchmarks/bench_async.py --smoke --steps 3         # 2 prompts x 2 samples x 16 tokens: about 6 minutes
    python benchmarks/bench_async.py --arms a b --overrides rollout.max_new_tokens=64
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import json
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(REPO))

TARGET_K1 = 0.7  # K=1's step should take at most this share of the synchronous step's
GPU_GENERATION_SHARES = (0.7, 0.8)
# One generation batch a step (no dynamic sampling), small enough for a CPU step; no validation, checkpoint or summary.
JOB_OVERRIDES = (
    "data.prompts_per_step=4",
    "rollout.n=4",
    "rollout.max_new_tokens=96",
    "algorithm.collection.dynamic_sampling=false",
    "validation.before_fit=false",
    "trainer.val_check_interval=1000",
    "callbacks=minimal",
    "summary=false",
)
SMOKE_OVERRIDES = ("data.prompts_per_step=2", "rollout.n=2", "rollout.max_new_tokens=16")
ARMS = {
    "a": {"label": "server K=0", "overrides": ["rollout=server", "rollout.max_staleness=0"], "staleness": 0},
    "b": {"label": "server K=1", "overrides": ["rollout=server", "rollout.max_staleness=1"], "staleness": 1},
    "c": {"label": "server K=2", "overrides": ["rollout=server", "rollout.max_staleness=2"], "staleness": 2},
    "d": {"label": "colocated vllm", "overrides": ["rollout=vllm"], "staleness": None},
}
# The per-step columns summarised (metric name -> short name); absent ones (the colocated arm's async/*) are skipped.
COLUMNS = {
    "train/time/step_s": "step_s",
    "train/time/trainer_idle": "trainer_idle",
    "train/time/engine_idle": "engine_idle",
    "train/time/weight_push": "weight_push",
    "train/async/rollout_s": "rollout_s",
    "train/time/update": "update",
    "train/time/sync": "sync",
    "train/time/score": "score",
    "train/async/staleness/mean": "staleness",
}


def merge_overrides(*groups) -> list[str]:
    """The overrides of every group in order, a later one replacing an earlier one of the same key in its place."""
    merged: dict[str, str] = {}
    for group in groups:
        for override in group:
            merged[override.partition("=")[0].lstrip("+~")] = override
    return list(merged.values())


def load_bench_server():
    """``benchmarks/bench_server.py`` as a module (for its CPU-seconds helpers): benchmarks/ is no package."""
    spec = importlib.util.spec_from_file_location("bench_server", REPO / "benchmarks" / "bench_server.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# -- one fit -------------------------------------------------------------------------------------------------------
def fit_command(arm: str, steps: int, out_dir: Path, job: list[str], url: str | None) -> list[str]:
    args = [sys.executable, "-m", "stare_lightning", "fit", "experiment=smollm2_countdown", *ARMS[arm]["overrides"]]
    if ARMS[arm]["staleness"] is not None:
        args += ["rollout.server.launch=false", f"rollout.server.urls=[{url}]"]
    return [*args, f"trainer.max_steps={steps}", f"output_dir={out_dir}", *job]


def read_steps(metrics_csv: Path) -> list[dict[str, float]]:
    """The training rows of a fit's metrics.csv (validation rows have no step time), numbers only."""
    with open(metrics_csv) as handle:
        rows = [{k: float(v) for k, v in r.items() if v not in ("", None)} for r in csv.DictReader(handle)]
    return [r for r in rows if "train/time/step_s" in r]


def run_fit(arm: str, args, job: list[str], out_dir: Path, url: str | None, token: str, all_cpus: set[int]) -> dict:
    """One fit of ``arm``; its training rows, wall time and log paths. Raises ``RuntimeError`` with the log's tail."""
    out_dir.mkdir(parents=True)
    env = {**os.environ, "STARE_LIGHTNING_SERVER_TOKEN": token, "PYTHONUNBUFFERED": "1"}
    if ARMS[arm]["staleness"] is not None:
        env["OMP_NUM_THREADS"] = "1"
        cpus = {args.trainer_cpu}
    else:  # the colocated default: whatever torch and vLLM choose on every core
        env.pop("OMP_NUM_THREADS", None)
        cpus = set(all_cpus)
    command = fit_command(arm, args.steps, out_dir, job, url)
    stdout, stderr = out_dir / "stdout.log", out_dir / "stderr.log"
    start = time.perf_counter()
    with open(stdout, "w") as out, open(stderr, "w") as err:
        try:
            code = subprocess.run(
                command,
                cwd=out_dir,
                env=env,
                stdout=out,
                stderr=err,
                timeout=args.fit_timeout,
                preexec_fn=lambda: os.sched_setaffinity(0, cpus),
            ).returncode
        except subprocess.TimeoutExpired:
            code = f"timeout after {args.fit_timeout:g} s"
    wall = time.perf_counter() - start
    if code != 0:
        tail = stderr.read_text(errors="replace")[-args.log_tail :]
        raise RuntimeError(f"the fit of arm {arm} ({ARMS[arm]['label']}) failed ({code}); {stderr}:\n{tail}")
    return {"command": command, "wall_s": wall, "rows": read_steps(out_dir / "logs" / "metrics.csv")}


# -- summaries -----------------------------------------------------------------------------------------------------
def step_values(rows: list[dict[str, float]]) -> list[dict[str, float]]:
    """Each step's summarised columns, the colocated arm's generation in ``rollout_s`` and the idle fraction."""
    out = []
    for row in rows:
        values = {short: row[name] for name, short in COLUMNS.items() if name in row}
        if "rollout_s" not in values:  # colocated: generation, tools and verifiers ran inside the step
            values["rollout_s"] = sum(row.get(f"train/time/{p}", 0.0) for p in ("rollout", "tool", "verify"))
        if "trainer_idle" in values:
            values["idle_fraction"] = values["trainer_idle"] / values["step_s"]
        out.append(values)
    return out


def summarise_arm(runs: list[dict], warmup: int) -> dict:
    """Medians over the timed steps (after the first ``warmup``) of every round's fit of one arm, pooled."""
    timed, per_round = [], []
    for run in runs:
        steps = step_values(run["rows"])
        kept = steps[warmup:] or steps[-1:]  # a fit shorter than the warm-up: its last step only
        timed += kept
        per_round.append(statistics.median(s["step_s"] for s in kept))
    names = sorted({k for s in timed for k in s})
    medians = {k: statistics.median(s[k] for s in timed if k in s) for k in names}
    return {
        "rounds": len(runs),
        "timed_steps": len(timed),
        "median": medians,
        "step_s_per_round": per_round,
        "step_s_all": [[r["train/time/step_s"] for r in run["rows"]] for run in runs],
        "steps": [step_values(run["rows"]) for run in runs],  # every step of every round, warm-up included
        "fit_wall_s": [run["wall_s"] for run in runs],
        "server_cpu_s": [run.get("server_cpu_s") for run in runs],
    }


def ratios(summary: dict, arm: str, base: str = "a") -> dict | None:
    if arm not in summary or base not in summary:
        return None
    pooled = summary[arm]["median"]["step_s"] / summary[base]["median"]["step_s"]
    rounds = [x / y for x, y in zip(summary[arm]["step_s_per_round"], summary[base]["step_s_per_round"])]
    return {"pooled": pooled, "per_round": rounds}


def prediction(sync: dict) -> dict:
    """What the synchronous arm's shares imply for a step with perfect overlap (see the module's docstring)."""
    step = sync["median"]["step_s"]
    g, p = sync["median"]["rollout_s"] / step, sync["median"].get("weight_push", 0.0) / step
    return {
        "generation_share": g,
        "push_share": p,
        "this_run_k1_bound": max(g, 1 - g - p) + p,
        "gpu": {f"{share:.1f}": max(share, 1 - share) + p for share in GPU_GENERATION_SHARES},
    }


# -- report --------------------------------------------------------------------------------------------------------
def fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def print_report(results: dict) -> None:
    summary, warmup = results["arms"], results["warmup"]
    print(f"\nexperiment=smollm2_countdown {' '.join(results['job'])}; {results['steps']} steps a fit, medians over "
          f"steps after the first {warmup} (after max({warmup}, K) for K), {results['rounds']} round(s)\n")  # fmt: skip
    head = ("arm", "step_s", "trainer_idle", "idle frac", "engine_idle", "weight_push", "rollout_s", "update", "sync",
            "score", "staleness", "steps", "server CPU s")  # fmt: skip
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for arm, arm_summary in summary.items():
        m = arm_summary["median"]
        cpu = [c for c in arm_summary["server_cpu_s"] if c is not None]
        cells = [
            f"({arm}) {ARMS[arm]['label']}",
            fmt(m["step_s"]),
            fmt(m.get("trainer_idle")),
            "-" if "idle_fraction" not in m else f"{m['idle_fraction']:.0%}",
            fmt(m.get("engine_idle")),
            fmt(m.get("weight_push"), 3),
            fmt(m.get("rollout_s")),
            fmt(m.get("update")),
            fmt(m.get("sync"), 3),
            fmt(m.get("score")),
            fmt(m.get("staleness"), 1),
            str(arm_summary["timed_steps"]),
            ", ".join(f"{c:.1f}" for c in cpu) or "-",
        ]
        print("| " + " | ".join(cells) + " |")
    print("\n| ratio of step_s | pooled medians | per round |\n|---|---|---|")
    for name, value in results["ratios"].items():
        if value is None:
            continue
        target = ""
        if name == "K=1 / K=0":
            target = f" (target <= {TARGET_K1}: {'met' if value['pooled'] <= TARGET_K1 else 'NOT met'})"
        rounds = ", ".join(f"{r:.3f}" for r in value["per_round"])
        print(f"| {name} | {value['pooled']:.3f}{target} | {rounds} |")
    pred, k1 = results.get("prediction"), results["ratios"].get("K=1 / K=0")
    if pred is not None:
        measured = f" (measured K=1 / K=0: {k1['pooled']:.3f})" if k1 is not None else ""
        print(
            f"\nprediction: the synchronous step here is {pred['generation_share']:.0%} generation (g), "
            f"{pred['push_share']:.1%} push (p); with perfect overlap K>=1 would take max(g, 1-g-p) + p = "
            f"{pred['this_run_k1_bound']:.3f} of it{measured}"
        )
        for share, ratio in pred["gpu"].items():
            print(f"prediction, GPU cluster with generation {float(share):.0%} of the synchronous step: "
                  f"max(g, 1-g) + p = {ratio:.3f} (p = {pred['push_share']:.1%}, measured here)")  # fmt: skip
    for failure in results["failures"]:
        print(f"\nFAILED: round {failure['round']}, arm ({failure['arm']}):\n{failure['error']}")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps a fit")
    parser.add_argument("--rounds", type=int, default=1, help="rounds of the arms, alternating")
    parser.add_argument("--warmup", type=int, default=2, help="steps not timed (at least K for the K arms)")
    parser.add_argument("--arms", nargs="+", choices=sorted(ARMS), default=sorted(ARMS))
    parser.add_argument("--smoke", action="store_true", help="a tiny job: " + " ".join(SMOKE_OVERRIDES))
    parser.add_argument("--overrides", nargs="*", default=[], help="more overrides for every arm's fit")
    parser.add_argument("--trainer-cpu", type=int, default=0)
    parser.add_argument("--engine-cpu", type=int, default=1)
    parser.add_argument("--fit-timeout", type=float, default=3600.0, help="seconds a fit may take")
    parser.add_argument("--log-tail", type=int, default=6000, help="characters of a failed fit's stderr shown")
    parser.add_argument("--keep", type=Path, default=None, help="keep the fits' and server's logs in this directory")
    parser.add_argument("--cache-dir", default=None, help="model cache (default: $STARE_LIGHTNING_CACHE or ~/.cache)")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args(argv)
    if args.trainer_cpu == args.engine_cpu:
        parser.error("--trainer-cpu and --engine-cpu must differ")
    all_cpus = os.sched_getaffinity(0)
    if not {args.trainer_cpu, args.engine_cpu} <= all_cpus:
        parser.error(f"--trainer-cpu and --engine-cpu must be among this process's CPUs {sorted(all_cpus)}")
    if args.cache_dir:
        os.environ["STARE_LIGHTNING_CACHE"] = str(Path(args.cache_dir).expanduser())  # the fits read it too
    job = merge_overrides(JOB_OVERRIDES, SMOKE_OVERRIDES if args.smoke else (), args.overrides)

    from stare_lightning.models.registry import resolve_model
    from stare_lightning.rollout.server.trainer_side.launch import LaunchedServers, ServerSpec, free_ports

    bench_server = load_bench_server()
    model_dir = resolve_model("smollm2-135m-instruct")
    results: dict = {
        "model": str(model_dir),
        "job": job,
        "steps": args.steps,
        "rounds": args.rounds,
        "warmup": args.warmup,
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "failures": [],
    }
    if args.keep is not None and args.keep.exists() and any(args.keep.iterdir()):
        parser.error(f"--keep {args.keep} is not empty")
    work = Path(tempfile.mkdtemp(prefix="bench_async_")) if args.keep is None else args.keep
    work.mkdir(parents=True, exist_ok=True)
    servers, runs = None, {arm: [] for arm in args.arms}
    try:
        url, meter, token = None, None, secrets.token_urlsafe(24)
        if any(ARMS[arm]["staleness"] is not None for arm in args.arms):
            spec = ServerSpec(port=free_ports(1)[0], cpus=str(args.engine_cpu))
            servers = LaunchedServers(model_dir, [spec], log_dir=work / "server", token=token)
            start = time.perf_counter()
            servers.start()
            results["server_start_s"] = time.perf_counter() - start
            url, meter = servers.urls[0], bench_server.CpuMeter(bench_server.server_processes(spec.port))
            print(f"server {url} up in {results['server_start_s']:.0f} s on CPU {args.engine_cpu}", flush=True)
        for r in range(args.rounds):
            for arm in args.arms:
                if meter is not None:
                    meter.start()
                try:
                    run = run_fit(arm, args, job, work / f"round{r + 1}_{arm}", url, token, all_cpus)
                except RuntimeError as error:
                    results["failures"].append({"round": r + 1, "arm": arm, "error": str(error)})
                    print(f"round {r + 1}, arm ({arm}): FAILED", flush=True)
                    continue
                if meter is not None:
                    run["server_cpu_s"] = sum(meter.stop().values())
                runs[arm].append(run)
                steps = ", ".join(f"{row['train/time/step_s']:.1f}" for row in run["rows"])
                print(f"round {r + 1}, arm ({arm}) {ARMS[arm]['label']}: {run['wall_s']:.0f} s wall, steps {steps} s",
                      flush=True)  # fmt: skip
    finally:
        if servers is not None:
            servers.stop()
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)

    summary = {}
    for arm, arm_runs in runs.items():
        if arm_runs:
            warmup = max(args.warmup, ARMS[arm]["staleness"] or 0)
            summary[arm] = summarise_arm(arm_runs, warmup)
    results["arms"] = summary
    results["ratios"] = {
        "K=1 / K=0": ratios(summary, "b"),
        "K=2 / K=0": ratios(summary, "c"),
        "colocated / K=0": ratios(summary, "d"),
    }
    if "a" in summary:
        results["prediction"] = prediction(summary["a"])
    print_report(results)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    if results["failures"]:
        sys.exit(1)
    return results


if __name__ == "__main__":
    main()
