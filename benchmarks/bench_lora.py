"""LoRA's weight sync on SmolLM2-135M-Instruct (rank 16): the merged model against the adapters only.

Measured, in one process (all CPU here):

1. The colocated engine (``rollout=vllm``): ``--syncs`` syncs of a rank-16 LoRA policy into an in-process vLLM engine
   holding merged weights (``rollout.lora_sync=merged``) and into one serving adapters (``adapter``). The two
   engines are built one after the other (two in-process engines cannot share the process), ``--rounds`` times in
   alternation, so drift in the machine's load hits both.
2. A stock vLLM server (``rollout=server``) that this script starts with runtime LoRA loading: the push of the
   merged model (pause, chunk files, layerwise reload, resume) and the load of the adapters, alternating sync by
   sync on the same server. (A merged push replaces the server's base, so adapters loaded afterwards sit on a
   changed base: the timings and bytes are what this measures, not the served log-probs, which the tests check.)
3. The reference model a KL term needs: with full fine-tuning a frozen copy of the policy; with LoRA the policy
   with its adapters off (``models/reference.py``). Reported: the copy's parameter bytes, the memory LoRA saves.
4. With ``--fit-steps N``: short fits of ``experiment=smollm2_countdown model.lora.rank=16`` in each mode, colocated
   and with a launched server, reporting the median ``train/time/step_s`` and ``train/time/sync`` over the steps
   after the first (the arms alternate in that order), and the bytes of the ``last.ckpt`` each wrote (the adapters,
   their AdamW moments and the run's state: the frozen base is left out, ``trainer/frozen_base.py``).

Then a projection for Qwen2.5-7B at rank 16 from its published shape: the bytes of each mode (bf16 weights, fp32
adapters as the trainer keeps them), and the seconds at the bytes-per-second each path reached here. A projection
from a CPU's throughput, stated as such: a GPU node moves bytes at other rates.

    python benchmarks/bench_lora.py                          # syncs only: about 5 minutes on 2 cores
    python benchmarks/bench_lora.py --fit-steps 4 --json lora.json   # and four fits: about 25 minutes more
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
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

RANK = 16
TOKEN = "bench-token-" + "0123456789abcdef" * 3
# Qwen2.5-7B's published shape (its config.json): what the projection scales to.
QWEN_7B = dict(hidden=3584, intermediate=18944, layers=28, heads=28, kv_heads=4, vocab=152064, tied=False)
FIT_JOB = ["experiment=smollm2_countdown", "model.lora.rank=16", "optim.lr=1e-5", "data.prompts_per_step=2",
           "rollout.n=4", "rollout.max_new_tokens=32", "validation.before_fit=false", "trainer.val_check_interval=1000",
           "summary=false"]  # fmt: skip


def lora_policy(model_dir: str):
    """SmolLM2 with rank-16 adapters set at random (as after some training: B no longer 0)."""
    import torch
    from transformers import AutoModelForCausalLM

    from stare_lightning.models.config import LoraConfig
    from stare_lightning.models.lora import apply_lora

    policy = apply_lora(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), LoraConfig(rank=RANK))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in policy.named_parameters():
            if ".lora_B." in name:
                param.copy_(0.01 * torch.randn(param.shape, generator=generator))
    return policy.eval()


def time_colocated(model_dir: str, policy, mode: str, syncs: int) -> dict:
    from stare_lightning.models.config import LoraConfig
    from stare_lightning.rollout.adapters import AdapterSync
    from stare_lightning.rollout.backends import ROLLOUT_BACKENDS
    from stare_lightning.rollout.vllm import VLLMRolloutEngine

    served = ROLLOUT_BACKENDS["vllm"].adapter_rank(RANK)
    adapters = AdapterSync.of(LoraConfig(rank=RANK), served) if mode == "adapter" else None
    engine = VLLMRolloutEngine(model_dir, seed=0, adapters=adapters, max_model_len=512)
    try:
        seconds, sizes = [], []
        for _ in range(syncs):
            engine.sync_weights(policy)
            seconds.append(engine.last_sync_seconds)
            sizes.append(engine.last_sync_bytes)
    finally:
        engine.close()
    return {"seconds": seconds, "bytes": sizes[-1]}


def time_server(model_dir: str, policy, syncs: int, log_dir: Path) -> dict:
    from stare_lightning.models.config import LoraConfig
    from stare_lightning.rollout.adapters import AdapterSync
    from stare_lightning.rollout.backends import ROLLOUT_BACKENDS
    from stare_lightning.rollout.server.trainer_side.client import ServerClient
    from stare_lightning.rollout.server.trainer_side.engine import ServerRolloutEngine
    from stare_lightning.rollout.server.trainer_side.launch import LaunchedServers, ServerSpec
    from stare_lightning.rollout.transfer_dir import default_base

    adapters = AdapterSync.of(LoraConfig(rank=RANK), ROLLOUT_BACKENDS["server"].adapter_rank(RANK))
    sockets = Path(tempfile.mkdtemp(prefix="bench-lora-servers-", dir=default_base()))
    spec = ServerSpec(0, uds=str(sockets / "0.sock"))
    results = {"merged": {"seconds": []}, "adapter": {"seconds": []}}
    with LaunchedServers(model_dir, [spec], log_dir=log_dir, token=TOKEN, max_model_len=512, socket_dir=sockets,
                         adapters=adapters) as launched:  # fmt: skip
        client = ServerClient(launched.urls[0], token=TOKEN, timeout=600)
        engines = {
            "merged": ServerRolloutEngine([client], chunk_bytes=64 << 20),
            "adapter": ServerRolloutEngine([client], chunk_bytes=64 << 20, adapters=adapters, run_tag="bench"),
        }
        try:
            for _ in range(syncs):
                for mode, engine in engines.items():  # alternating, sync by sync
                    engine.sync_weights(policy)
                    results[mode]["seconds"].append(engine.last_sync_seconds)
                    results[mode]["bytes"] = engine.last_sync_bytes
        finally:
            for engine in engines.values():
                engine.launched = None  # the server is this script's, stopped below
                engine.close()
    return results


def reference_bytes(model_dir: str) -> int:
    from stare_lightning.models.config import ModelConfig
    from stare_lightning.models.loading import load_reference

    reference = load_reference(model_dir, ModelConfig(dtype="float32"))
    return sum(p.numel() * p.element_size() for p in reference.parameters())


def qwen_7b_bytes(rank: int) -> dict:
    """The bytes of one sync of Qwen2.5-7B: merged (bf16) and rank-``rank`` adapters on the seven projections
    (fp32, as the trainer keeps them), from the published shape."""
    q = QWEN_7B
    head_dim = q["hidden"] // q["heads"]
    kv = q["kv_heads"] * head_dim
    h, i = q["hidden"], q["intermediate"]
    # (in, out) of q, k, v, o, gate, up, down; q/k/v carry biases in Qwen2.
    projections = [(h, h), (h, kv), (h, kv), (h, h), (h, i), (h, i), (i, h)]
    per_layer = sum(n_in * n_out for n_in, n_out in projections) + h + 2 * kv + 2 * h  # + biases and two norms
    params = q["layers"] * per_layer + q["vocab"] * h * (1 if q["tied"] else 2) + h
    adapter_params = q["layers"] * rank * sum(n_in + n_out for n_in, n_out in projections)
    return {"params": params, "merged_bytes": 2 * params, "adapter_bytes": 4 * adapter_params}


def run_fit(mode: str, engine: str, steps: int, out: Path, cache: str) -> dict:
    run = out / f"{engine}-{mode}"
    args = ["fit", f"output_dir={run}", *FIT_JOB, f"rollout={engine}", f"rollout.lora_sync={mode}",
            f"trainer.max_steps={steps}"]  # fmt: skip
    env = {**os.environ, "STARE_LIGHTNING_CACHE": cache, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    proc = subprocess.run([sys.executable, "-m", "stare_lightning", *args], cwd=out, env=env, capture_output=True,
                          text=True)  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(f"fit {engine}/{mode} failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    rows = [r for r in csv.DictReader(open(run / "logs" / "metrics.csv")) if r.get("train/time/step_s")]
    rows = rows[1:]  # the first step starts the engine
    median = lambda key: statistics.median(float(r[key]) for r in rows if r.get(key))  # noqa: E731
    checkpoint_bytes = (run / "checkpoints" / "last.ckpt").stat().st_size
    return {"step_s": median("train/time/step_s"), "sync_s": median("train/time/sync"), "steps": len(rows),
            "checkpoint_bytes": checkpoint_bytes}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--syncs", type=int, default=5, help="syncs timed per engine and mode")
    parser.add_argument("--rounds", type=int, default=2, help="colocated engine pairs, alternating modes")
    parser.add_argument("--fit-steps", type=int, default=0, help="also run short fits of this many steps (0: none)")
    parser.add_argument("--fits-only", action="store_true", help="skip the sync timings (with --fit-steps)")
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args()

    from stare_lightning.models.registry import SMOLLM2, default_cache_dir, resolve_model

    cache = os.environ.get("STARE_LIGHTNING_CACHE") or str(default_cache_dir())
    model_dir = str(resolve_model(SMOLLM2, cache))
    report: dict = {"model": SMOLLM2, "rank": RANK}
    if not args.fits_only:
        report.update(time_syncs(model_dir, args))
    if args.fit_steps:
        report["fits"] = time_fits(args.fit_steps, cache)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


def time_syncs(model_dir: str, args) -> dict:
    """Parts 1-3 and the projection (module docstring)."""
    policy = lora_policy(model_dir)
    report: dict = {}

    colocated: dict = {"merged": {"seconds": []}, "adapter": {"seconds": []}}
    for _ in range(args.rounds):
        for mode in ("merged", "adapter"):
            result = time_colocated(model_dir, policy, mode, args.syncs)
            colocated[mode]["seconds"] += result["seconds"][1:]  # the first sync of an engine warms it up
            colocated[mode]["bytes"] = result["bytes"]
    with tempfile.TemporaryDirectory() as logs:
        server = time_server(model_dir, policy, args.syncs + 1, Path(logs))
    for result in server.values():
        result["seconds"] = result["seconds"][1:]
    report["sync"] = {"colocated": colocated, "server": server}
    report["reference_bytes_saved"] = reference_bytes(model_dir)

    print(f"SmolLM2-135M-Instruct, LoRA rank {RANK}: one weight sync (median over {args.syncs - 1} x {args.rounds} "
          f"colocated, {args.syncs} on the server)")  # fmt: skip
    print(f"{'engine':10s} {'mode':8s} {'bytes':>12s} {'median s':>9s} {'MB/s':>8s}")
    for engine, modes in report["sync"].items():
        for mode, result in modes.items():
            result["median_s"] = statistics.median(result["seconds"])
            result["mb_per_s"] = result["bytes"] / result["median_s"] / 1e6
            print(f"{engine:10s} {mode:8s} {result['bytes']:12,d} {result['median_s']:9.3f} {result['mb_per_s']:8.1f}")
        print(f"{engine:10s} merged / adapter: {modes['merged']['bytes'] / modes['adapter']['bytes']:.0f}x the bytes, "
              f"{modes['merged']['median_s'] / modes['adapter']['median_s']:.1f}x the seconds")  # fmt: skip
    print(
        f"reference model a KL term no longer loads with LoRA: {report['reference_bytes_saved'] / 2**20:.0f} MiB "
        "(fp32 parameters)"
    )

    projection = qwen_7b_bytes(RANK)
    for engine, modes in report["sync"].items():
        projection[f"{engine}_merged_s"] = projection["merged_bytes"] / (modes["merged"]["mb_per_s"] * 1e6)
        projection[f"{engine}_adapter_s"] = projection["adapter_bytes"] / (modes["adapter"]["mb_per_s"] * 1e6)
    report["projection_qwen2.5_7b"] = projection
    print(f"projection, Qwen2.5-7B rank {RANK} ({projection['params'] / 1e9:.2f} B parameters): merged "
          f"{projection['merged_bytes'] / 1e9:.1f} GB (bf16), adapters {projection['adapter_bytes'] / 1e6:.0f} MB "
          f"(fp32); at this machine's rates: colocated {projection['colocated_merged_s']:.0f} s vs "
          f"{projection['colocated_adapter_s']:.1f} s, server {projection['server_merged_s']:.0f} s vs "
          f"{projection['server_adapter_s']:.1f} s per sync")  # fmt: skip

    return report


def time_fits(steps: int, cache: str) -> dict:
    """Part 4: a short fit per engine and mode."""
    fits: dict = {}
    with tempfile.TemporaryDirectory() as out:
        for engine in ("vllm", "server"):
            for mode in ("merged", "adapter"):
                fit = fits[f"{engine}/{mode}"] = run_fit(mode, engine, steps, Path(out), cache)
                megabytes = fit["checkpoint_bytes"] / 1e6
                print(f"fit {engine:6s} {mode:8s}: step {fit['step_s']:.2f} s, sync {fit['sync_s']:.3f} s "
                      f"(median of {fit['steps']} steps), last.ckpt {megabytes:.0f} MB")  # fmt: skip
    return fits


if __name__ == "__main__":
    main()
