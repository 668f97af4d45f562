"""``rollout=server`` on SmolLM2-135M-Instruct: the weight push, the cost of HTTP per request, and tokens/s.

One stock vLLM server (``rollout/server/trainer_side/launch.py``) is pinned to ``--engine-cpu`` and this process, the
trainer, to ``--trainer-cpu`` with one torch thread. Measured:

1. The weight push: ``ServerRolloutEngine.sync_weights`` of the SmolLM2 policy (fp32, ``--chunk-mb`` chunks),
   ``--pushes`` times after one untimed first push (which also opens the transfer directory); the median is
   split into the HTTP round trips (pause, start, one update per chunk, finish with the server's apply, resume;
   timed around each request) and the rest (gather + pack + write of the chunk files), which is also timed on
   its own (``write_chunks`` into a scratch directory). The push is set against a training step: ``--fit-steps``
   steps of ``experiment=smollm2_countdown`` with ``rollout=server`` on this same server, the fit pinned to the
   trainer's core with one thread (median ``train/time/step_s`` over the steps after the first). By default the
   fit turns dynamic sampling off: one generation batch a step, the experiment's lightest step, so the push's
   share is an upper bound (with it, a step of the untrained policy draws up to 10 batches). Target: at most 10%.
2. Generation against the in-process engine (``VLLMRolloutEngine``, in a child process pinned to the engine's
   core, so both contenders get the same single core): the same countdown prompts, seeds and sampling settings,
   alternating in-process / server for ``--rounds`` rounds after one untimed warm-up each. Reported: the ratio of
   wall times, the difference per request (one HTTP request per prompt), and whether every sample's token ids
   are identical. The in-process wall time includes a pipe round trip to the child (negligible against a
   generation). On shared cores wall times also carry other processes' load, so each contender's CPU seconds
   (from /proc: the child; the server's API process, engine core and worker) are reported too. After the
   pushes the server draws round 1 again: the pushed weights must give the same samples.
3. Tokens/s of generation for both: generated tokens (EOS included) over wall time.

    python benchmarks/bench_server.py                                  # about 10 minutes on 2 cores
    python benchmarks/bench_server.py --skip-fit --rounds 2            # no training step: 3 minutes
    python benchmarks/bench_server.py --fit-steps 4 --fit-overrides    # the step as configured (dynamic sampling)
    python benchmarks/bench_server.py --json out.json
"""

from __future__ import annotations

import argparse
import csv
import json
import multiprocessing
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from stare_lightning.rollout.base import SamplingParams  # noqa: E402
from stare_lightning.rollout.server.trainer_side.client import ServerClient  # noqa: E402

PUSH_TARGET = 0.10  # a push should cost at most this share of a training step
PUSH_ROUTES = ("/pause", "/start_weight_update", "/update_weights", "/finish_weight_update", "/resume")
CHILD_TIMEOUT_S = 900.0
PROCESS_ROLES = {"VLLM::EngineCor": "engine_core", "VLLM::Worker": "worker"}
# One generation batch a step: the experiment's lightest step, so the push's share of it is an upper bound. (With
# dynamic sampling, as configured, a step of the untrained policy draws up to 10 batches: all its groups score 0.)
FIT_OVERRIDES = ("algorithm.collection.dynamic_sampling=false",)


class TimedClient(ServerClient):
    """A ``ServerClient`` that adds up the wall time of its HTTP round trips per route (query strings dropped)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self.seconds: dict[str, float] = defaultdict(float)
            self.calls: dict[str, int] = defaultdict(int)

    def _request(self, method, path, body=None, *, timeout=None):
        start = time.perf_counter()
        try:
            return super()._request(method, path, body, timeout=timeout)
        finally:
            route = path.partition("?")[0]
            with self._lock:
                self.seconds[route] += time.perf_counter() - start
                self.calls[route] += 1


# -- the in-process engine, in a child pinned to the engine's core ------------------------------------------
def in_process_engine(conn, model_dir: str, cpu: int) -> None:
    """Child process: a ``VLLMRolloutEngine`` on ``cpu`` answering ``(prompts, params, seeds)`` over ``conn``."""
    try:
        os.sched_setaffinity(0, {cpu})
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(cpu)  # vLLM's own choice would span the NUMA node
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        torch.set_num_threads(1)
        from stare_lightning.rollout.vllm import VLLMRolloutEngine

        engine = VLLMRolloutEngine(model_dir, seed=0)
        conn.send(("ready", engine.start_seconds))
        while (request := conn.recv()) is not None:
            out = engine.generate(*request)
            conn.send(("done", (out.response_ids, out.response_logprobs)))
        engine.close()
    except BaseException:
        conn.send(("error", traceback.format_exc()))


class ChildEngine:
    """The parent's handle on ``in_process_engine``: ``generate`` returns the samples' token ids and log-probs."""

    def __init__(self, model_dir: Path, cpu: int) -> None:
        context = multiprocessing.get_context("spawn")
        self.conn, child_conn = context.Pipe()
        self.process = context.Process(target=in_process_engine, args=(child_conn, str(model_dir), cpu), daemon=True)
        self.process.start()
        self.start_seconds: float | None = None

    def _answer(self):
        if not self.conn.poll(CHILD_TIMEOUT_S):
            raise TimeoutError(f"the in-process engine's child did not answer within {CHILD_TIMEOUT_S:g} s")
        kind, value = self.conn.recv()
        if kind == "error":
            raise RuntimeError(f"the in-process engine's child failed:\n{value}")
        return value

    def wait_ready(self) -> None:
        self.start_seconds = self._answer()

    def generate(self, prompts, params, seeds):
        self.conn.send((prompts, params, seeds))
        return self._answer()

    def close(self) -> None:
        if self.process.is_alive():
            self.conn.send(None)
            self.process.join(60)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()


# -- workload ------------------------------------------------------------------------------------------------
def countdown_prompts(tokenizer, count: int) -> list[list[int]]:
    """``experiment=smollm2_countdown``'s first training prompts, chat-formatted as that run encodes them."""
    from stare_lightning.data.prompts import encode_prompt
    from stare_lightning.data.tasks.countdown import CountdownParams, make_records

    records = make_records("train", count, style="instruct", seed=0, val_size=16, params=CountdownParams())
    return [encode_prompt(r, tokenizer, style="instruct", max_length=256)[0] for r in records]


def round_seeds(round_index: int, prompts: int) -> list[int]:
    return [1000 * (round_index + 1) + i for i in range(prompts)]


# -- CPU time: what each contender's processes used, whoever else shares the cores --------------------------------
def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of one process (all its threads) so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def server_processes(port: int) -> dict[int, str]:
    """pid -> role of every process of the server listening on ``port`` (its process group: the API server,
    vLLM's engine core and worker)."""
    leader = None
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        if b"vllm.entrypoints.openai.api_server" in argv and b"--port" in argv:
            if argv[argv.index(b"--port") + 1] == str(port).encode():
                leader = int(proc.name)
    if leader is None:
        raise RuntimeError(f"no vLLM server process listens on port {port}")
    roles = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if os.getpgid(int(proc.name)) != leader:
                continue
            name = (proc / "comm").read_text().strip()
        except OSError:
            continue
        # /proc's comm is cut at 15 characters: "VLLM::EngineCor"; the rest is multiprocessing's resource tracker.
        roles[int(proc.name)] = "api_server" if int(proc.name) == leader else PROCESS_ROLES.get(name, "other")
    return roles


class CpuMeter:
    """CPU seconds the given processes use between ``start`` and ``stop``, by role."""

    def __init__(self, roles: dict[int, str]) -> None:
        self.roles = roles

    def start(self) -> None:
        self._before = {pid: cpu_seconds(pid) for pid in self.roles}

    def stop(self) -> dict[str, float]:
        used: dict[str, float] = defaultdict(float)
        for pid, role in self.roles.items():
            used[role] += cpu_seconds(pid) - self._before[pid]
        return dict(used)


# -- 2 and 3: generation, alternating ------------------------------------------------------------------------
def compare_generation(
    child: ChildEngine, server, prompts, params: SamplingParams, rounds: int, server_meter: CpuMeter
) -> dict:
    warm = SamplingParams(n=1, max_new_tokens=8, temperature=params.temperature)
    child.generate(prompts[:2], warm, [1, 2])
    server.generate(prompts[:2], warm, [1, 2])
    child_meter = CpuMeter({child.process.pid: "in_process"})
    rows: list[dict] = []
    for r in range(rounds):
        seeds = round_seeds(r, len(prompts))
        child_meter.start()
        start = time.perf_counter()
        ids_a, logprobs_a = child.generate(prompts, params, seeds)
        seconds_a = time.perf_counter() - start
        cpu_a = child_meter.stop()["in_process"]
        server_meter.start()
        start = time.perf_counter()
        out = server.generate(prompts, params, seeds)
        seconds_b = time.perf_counter() - start
        cpu_b = server_meter.stop()
        identical = ids_a == out.response_ids
        lp_diff = max(
            (abs(a - b) for la, lb in zip(logprobs_a, out.response_logprobs) for a, b in zip(la, lb)), default=0.0
        )
        rows.append(
            {
                "in_process_s": seconds_a,
                "server_s": seconds_b,
                "in_process_cpu_s": cpu_a,
                "server_cpu_s": cpu_b,
                "in_process_tokens": sum(map(len, ids_a)),
                "server_tokens": sum(map(len, out.response_ids)),
                "identical_ids": identical,
                "max_logprob_diff": lp_diff,
                "in_process_ids": ids_a,
            }
        )
        server_cpu = ", ".join(f"{role} {seconds:.2f}" for role, seconds in cpu_b.items())
        print(
            f"round {r + 1}: in-process {seconds_a:.2f} s wall, {cpu_a:.2f} s CPU ({rows[-1]['in_process_tokens']} "
            f"tokens); server {seconds_b:.2f} s wall, CPU {server_cpu} ({rows[-1]['server_tokens']} tokens); "
            f"identical ids: {identical}, max abs logprob diff {lp_diff:.2e}",
            flush=True,
        )
    return {"rounds": rows}


def summarise_generation(rows: list[dict], requests: int) -> dict:
    ratios = [r["server_s"] / r["in_process_s"] for r in rows]
    per_request = [(r["server_s"] - r["in_process_s"]) / requests for r in rows]
    total_a, total_b = sum(r["in_process_s"] for r in rows), sum(r["server_s"] for r in rows)
    cpu_a = [r["in_process_cpu_s"] for r in rows]
    cpu_b = [sum(r["server_cpu_s"].values()) for r in rows]
    return {
        "rounds": len(rows),
        "requests_per_round": requests,
        "in_process_median_s": statistics.median(r["in_process_s"] for r in rows),
        "server_median_s": statistics.median(r["server_s"] for r in rows),
        "ratio_median": statistics.median(ratios),
        "ratio_range": [min(ratios), max(ratios)],
        "per_request_extra_ms_median": 1000 * statistics.median(per_request),
        "in_process_cpu_median_s": statistics.median(cpu_a),
        "server_cpu_median_s": {
            role: statistics.median(r["server_cpu_s"][role] for r in rows) for role in rows[0]["server_cpu_s"]
        },
        "cpu_ratio_median": statistics.median(b / a for a, b in zip(cpu_a, cpu_b)),
        "per_request_extra_cpu_ms_median": 1000 * statistics.median((b - a) / requests for a, b in zip(cpu_a, cpu_b)),
        "in_process_tokens_per_s": sum(r["in_process_tokens"] for r in rows) / total_a,
        "server_tokens_per_s": sum(r["server_tokens"] for r in rows) / total_b,
        "all_identical_ids": all(r["identical_ids"] for r in rows),
        "max_logprob_diff": max(r["max_logprob_diff"] for r in rows),
    }


# -- 1: the weight push ------------------------------------------------------------------------------------
def time_pushes(engine, client: TimedClient, model, pushes: int) -> dict:
    engine.sync_weights(model)  # untimed: the first push also opens the transfer directory on the server
    first_s = engine.last_sync_seconds
    totals, http, routes = [], [], defaultdict(list)
    chunks = 0
    for _ in range(pushes):
        client.reset()
        engine.sync_weights(model)
        totals.append(engine.last_sync_seconds)
        http.append(sum(client.seconds[route] for route in PUSH_ROUTES))
        for route in PUSH_ROUTES:
            routes[route].append(client.seconds[route])
        chunks = client.calls["/update_weights"]
    return {
        "first_push_s": first_s,
        "pushes": pushes,
        "chunks": chunks,
        "push_median_s": statistics.median(totals),
        "push_range_s": [min(totals), max(totals)],
        "http_median_s": statistics.median(http),
        "pack_median_s": statistics.median(t - h for t, h in zip(totals, http)),
        "route_median_s": {route: statistics.median(values) for route, values in routes.items()},
    }


def time_packing(model, chunk_bytes: int, repeats: int) -> float:
    """Median seconds of gather + pack + write of the chunk files alone, into a scratch transfer directory."""
    from stare_lightning.rollout.server.shared.transfer import write_chunks
    from stare_lightning.rollout.transfer_dir import TransferDirectory
    from stare_lightning.rollout.weights import iter_full_weights

    directory, times = TransferDirectory(), []
    try:
        for _ in range(repeats):
            start = time.perf_counter()
            with torch.no_grad():
                for _ in write_chunks(iter_full_weights(model), directory, chunk_bytes=chunk_bytes):
                    pass
            times.append(time.perf_counter() - start)
            directory.clear()
    finally:
        directory.remove()
    return statistics.median(times)


# -- the training step: a short fit on the same server ---------------------------------------------------------
def time_fit_steps(url: str, token: str, cpu: int, steps: int, out_dir: Path, extra: list[str]) -> dict:
    args = [sys.executable, "-m", "stare_lightning", "fit", "experiment=smollm2_countdown", "rollout=server",
            "rollout.server.launch=false", f"rollout.server.urls=[{url}]", f"trainer.max_steps={steps}",
            "validation.before_fit=false", "trainer.val_check_interval=1000", "callbacks=minimal", "summary=false",
            f"output_dir={out_dir}", *extra]  # fmt: skip
    env = {**os.environ, "STARE_LIGHTNING_SERVER_TOKEN": token, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    start = time.perf_counter()
    done = subprocess.run(
        args, cwd=out_dir, env=env, capture_output=True, text=True, preexec_fn=lambda: os.sched_setaffinity(0, {cpu})
    )
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"the fit failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    with open(out_dir / "logs" / "metrics.csv") as handle:
        rows = [{k: float(v) for k, v in r.items() if v != ""} for r in csv.DictReader(handle)]
    rows = [r for r in rows if "train/time/step_s" in r]
    timed = rows[1:] or rows  # the first step also warms up

    def median(key: str) -> float:
        return statistics.median(r[f"train/{key}"] for r in timed)

    return {
        "overrides": extra,
        "steps": len(rows),
        "timed_steps": len(timed),
        "wall_s": wall,
        "step_s": median("time/step_s"),
        # Under rollout=server the batch is generated beside the step (step/producer.py): its own seconds.
        "rollout_s": median("async/rollout_s"),
        "update_s": median("time/update"),
        "sync_s": median("time/sync"),
        "step_s_all": [r["train/time/step_s"] for r in rows],
    }


# -- report ------------------------------------------------------------------------------------------------------
def steps_label(steps: int) -> str:
    return "step 2" if steps == 2 else f"median of steps 2-{steps}" if steps > 2 else "step 1"


def table_rows(results: dict) -> list[tuple[str, str]]:
    push, gen, fit = results["push"], results["generation"], results.get("fit")
    low, high = push["push_range_s"]
    rows = [
        (
            f"weight push, median of {push['pushes']} ({push['chunks']} chunks of {results['chunk_mb']} MB)",
            f"{push['push_median_s']:.3f} s (range {low:.3f}-{high:.3f})",
        ),
        ("- gather + pack + write (push minus HTTP)", f"{push['pack_median_s']:.3f} s"),
        ("- gather + pack + write, timed alone", f"{results['pack_alone_s']:.3f} s"),
        ("- HTTP round trips, all", f"{push['http_median_s']:.3f} s"),
    ]
    rows += [(f"- HTTP {route}", f"{seconds:.3f} s") for route, seconds in push["route_median_s"].items()]
    rows.append(("first push (opens the transfer directory)", f"{push['first_push_s']:.3f} s"))
    if fit is not None:
        share = push["push_median_s"] / fit["step_s"]
        rows += [
            (
                f"training step, smollm2_countdown {' '.join(fit['overrides'])} ({steps_label(fit['steps'])})",
                f"{fit['step_s']:.2f} s (rollout {fit['rollout_s']:.2f}, update {fit['update_s']:.2f}, "
                f"sync {fit['sync_s']:.3f})",
            ),
            (
                f"push / step (target <= {PUSH_TARGET:.0%})",
                f"{share:.1%} ({'met' if share <= PUSH_TARGET else 'NOT met'})",
            ),
        ]
    ratio_low, ratio_high = gen["ratio_range"]
    rows += [
        (f"generation wall, in-process (median of {gen['rounds']})", f"{gen['in_process_median_s']:.2f} s"),
        (f"generation wall, server (median of {gen['rounds']})", f"{gen['server_median_s']:.2f} s"),
        ("server / in-process wall (median, range)", f"{gen['ratio_median']:.3f} ({ratio_low:.3f}-{ratio_high:.3f})"),
        (
            f"extra wall per request ({gen['requests_per_round']} requests a round, median)",
            f"{gen['per_request_extra_ms_median']:.1f} ms",
        ),
        ("CPU seconds a round, in-process (median)", f"{gen['in_process_cpu_median_s']:.2f} s"),
        (
            "CPU seconds a round, server (median, by process)",
            ", ".join(f"{role} {seconds:.2f} s" for role, seconds in gen["server_cpu_median_s"].items()),
        ),
        ("server / in-process CPU seconds (median)", f"{gen['cpu_ratio_median']:.3f}"),
        ("extra CPU per request (median)", f"{gen['per_request_extra_cpu_ms_median']:.1f} ms"),
        ("tokens/s in-process", f"{gen['in_process_tokens_per_s']:.1f}"),
        ("tokens/s server", f"{gen['server_tokens_per_s']:.1f}"),
        (
            "identical token ids, every round",
            f"{'yes' if gen['all_identical_ids'] else 'NO'} (max abs logprob diff {gen['max_logprob_diff']:.1e})",
        ),
        (
            f"identical token ids after {push['pushes'] + 1} pushes (round 1 again)",
            "yes" if results["after_pushes_identical"] else "NO",
        ),
    ]
    return rows


def print_table(results: dict) -> None:
    print("\n| measure | value |\n|---|---|")
    for label, value in table_rows(results):
        print(f"| {label} | {value} |")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=8, help="prompts a round, one request each")
    parser.add_argument("--n", type=int, default=4, help="samples per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=3, help="in-process / server pairs, alternating")
    parser.add_argument("--pushes", type=int, default=5, help="timed weight pushes (after one untimed)")
    parser.add_argument("--chunk-mb", type=int, default=64, help="as rollout.server.chunk_mb")
    parser.add_argument("--fit-steps", type=int, default=2, help="the first is not timed")
    parser.add_argument("--fit-overrides", nargs="*", default=list(FIT_OVERRIDES), help="more overrides for the fit")
    parser.add_argument("--skip-fit", action="store_true", help="no training step (no push / step share)")
    parser.add_argument("--trainer-cpu", type=int, default=0)
    parser.add_argument("--engine-cpu", type=int, default=1)
    parser.add_argument("--cache-dir", default=None, help="model cache (default: $STARE_LIGHTNING_CACHE or ~/.cache)")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args(argv)
    if args.trainer_cpu == args.engine_cpu:
        parser.error("--trainer-cpu and --engine-cpu must differ")
    if args.cache_dir:
        os.environ["STARE_LIGHTNING_CACHE"] = str(Path(args.cache_dir).expanduser())  # the fit reads it too

    os.sched_setaffinity(0, {args.trainer_cpu})
    torch.set_num_threads(1)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from stare_lightning.models.registry import resolve_model
    from stare_lightning.rollout.server.trainer_side.engine import ServerRolloutEngine
    from stare_lightning.rollout.server.trainer_side.launch import LaunchedServers, ServerSpec, free_ports

    model_dir = resolve_model("smollm2-135m-instruct")
    results: dict = {"model": str(model_dir), "chunk_mb": args.chunk_mb, "settings": vars(args) | {"json": None}}
    with tempfile.TemporaryDirectory(prefix="bench_server_") as tmp:
        token = secrets.token_urlsafe(24)
        child = ChildEngine(model_dir, args.engine_cpu)  # loads while the server starts
        spec = ServerSpec(port=free_ports(1)[0], cpus=str(args.engine_cpu))
        servers = LaunchedServers(model_dir, [spec], log_dir=Path(tmp) / "servers", token=token)
        engine = None
        try:
            start = time.perf_counter()
            servers.start()
            results["server_start_s"] = time.perf_counter() - start
            client = TimedClient(servers.urls[0], token=token, timeout=600)
            engine = ServerRolloutEngine([client], chunk_bytes=args.chunk_mb << 20, launched=servers)
            child.wait_ready()
            results["in_process_start_s"] = child.start_seconds
            print(f"server up in {results['server_start_s']:.0f} s, in-process engine in {child.start_seconds:.0f} s"
                  " (started together on one core)", flush=True)  # fmt: skip

            tokenizer = AutoTokenizer.from_pretrained(model_dir)
            prompts = countdown_prompts(tokenizer, args.prompts)
            params = SamplingParams(n=args.n, max_new_tokens=args.max_new_tokens, temperature=args.temperature)
            server_meter = CpuMeter(server_processes(spec.port))
            compared = compare_generation(child, engine, prompts, params, args.rounds, server_meter)
            results["generation"] = summarise_generation(compared["rounds"], len(prompts))
            child.close()

            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
            results["push"] = time_pushes(engine, client, model, args.pushes)
            print(f"push: {results['push']}", flush=True)
            results["pack_alone_s"] = time_packing(model, args.chunk_mb << 20, args.pushes)
            again = engine.generate(prompts, params, round_seeds(0, len(prompts)))
            results["after_pushes_identical"] = again.response_ids == compared["rounds"][0]["in_process_ids"]
            del model

            if not args.skip_fit:
                fit_dir = Path(tmp) / "fit"
                fit_dir.mkdir()
                results["fit"] = time_fit_steps(
                    servers.urls[0], token, args.trainer_cpu, args.fit_steps, fit_dir, args.fit_overrides
                )
                print(f"fit: {results['fit']}", flush=True)
        finally:
            child.close()
            if engine is not None:
                engine.close()
            servers.stop()
    print_table(results)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return results


if __name__ == "__main__":
    main()
