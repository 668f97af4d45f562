"""The weight push over the network (``rollout.server.transfer=network``) against files, on SmolLM2-135M-Instruct.

One stock vLLM server on loopback TCP is pinned to ``--engine-cpu`` and this process, the trainer, to
``--trainer-cpu`` with one torch thread. The same fp32 policy is pushed ``--pushes`` times through each transfer
(after one untimed push each, which also sets the transfer up: the directory, or the groups' rendezvous), with
``ServerRolloutEngine.sync_weights`` as a run calls it; reported per transfer: the median push, the bytes a push
carries and bytes/s over the whole push. For the network, the packing with its digests (HMAC-SHA256 of every byte,
taken before a server is paused) is also timed alone, and the digest's rate on one core is measured on its own.

The projection for a 7B model in bf16 (7.6e9 parameters, 15.2 GB a push) at 100 and 400 Gb/s adds, without
overlap: the trainer's packing and digest at this machine's measured rate, the bytes at the link's rate, and the
server's digest of what it received at the same rate (the server's load into the model, which files pay too, is
not counted). It is a floor for one server: gloo over one TCP connection rarely fills such a link.

    python benchmarks/bench_transfer.py                 # about a minute on 2 quiet cores
    python benchmarks/bench_transfer.py --json out.json

With ``--url`` the server is one already running on another host (``serve``, its secret in
``$STARE_LIGHTNING_SERVER_TOKEN``): the network push goes from this host's address on the route to it, and files go
through ``--transfer-dir``, a directory both hosts mount. ``benchmarks/bench_transfer_cluster.sh`` runs it so
across two nodes of ``scripts/cluster.sh``.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import json
import os
import secrets
import statistics
import tempfile
import time
from pathlib import Path

import torch

from stare_lightning.rollout.server.trainer_side.client import ServerClient

PARAMS_7B = 7.6e9  # Qwen2.5-7B
BF16_BYTES = 2
LINKS_GBIT = (100, 400)


def time_pushes(engine, model, pushes: int) -> dict:
    engine.sync_weights(model)  # untimed: sets the transfer up
    first = engine.last_sync_seconds
    seconds = []
    for _ in range(pushes):
        engine.sync_weights(model)
        seconds.append(engine.last_sync_seconds)
    median = statistics.median(seconds)
    return {
        "first_push_s": first,
        "push_median_s": median,
        "push_range_s": [min(seconds), max(seconds)],
        "bytes": engine.last_sync_bytes,
        "bytes_per_s": engine.last_sync_bytes / median,
    }


def time_packing(model, token: str, chunk_bytes: int, repeats: int) -> float:
    from stare_lightning.rollout.server.shared.net_wire import pack_chunks
    from stare_lightning.rollout.weights import iter_full_weights

    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        list(pack_chunks(iter_full_weights(model), token, chunk_bytes))
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def digest_rate(size: int = 256 << 20) -> float:
    """Bytes/s of HMAC-SHA256 on one core."""
    payload = os.urandom(size)
    start = time.perf_counter()
    hmac.new(b"k" * 32, payload, hashlib.sha256).digest()
    return size / (time.perf_counter() - start)


def projection(pack_rate: float, digest_per_s: float) -> list[dict]:
    size = PARAMS_7B * BF16_BYTES
    rows = []
    for gbit in LINKS_GBIT:
        wire = size / (gbit * 1e9 / 8)
        rows.append(
            {
                "link_gbit": gbit,
                "bytes": size,
                "pack_s": size / pack_rate,
                "wire_s": wire,
                "server_digest_s": size / digest_per_s,
                "push_s": size / pack_rate + wire + size / digest_per_s,
            }
        )
    return rows


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pushes", type=int, default=5, help="timed pushes per transfer (after one untimed)")
    parser.add_argument("--chunk-mb", type=int, default=64, help="as rollout.server.chunk_mb")
    parser.add_argument("--trainer-cpu", type=int, default=0)
    parser.add_argument("--engine-cpu", type=int, default=1)
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument("--url", default=None, help="a running server on another host (default: launch one here)")
    parser.add_argument("--transfer-dir", default=None, help="with --url: a directory both hosts see, for files")
    args = parser.parse_args(argv)
    if (args.url is None) != (args.transfer_dir is None):
        parser.error("--url and --transfer-dir go together: files to a server on another host need a shared directory")
    os.sched_setaffinity(0, {args.trainer_cpu})
    torch.set_num_threads(1)

    from transformers import AutoModelForCausalLM

    from stare_lightning.models.registry import resolve_model
    from stare_lightning.rollout.server.trainer_side.launch import LaunchedServers, ServerSpec, free_ports

    model_dir = resolve_model("smollm2-135m-instruct")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    results: dict = {"model": str(model_dir), "settings": vars(args) | {"json": None}}
    if args.url is not None:
        token = os.environ["STARE_LIGHTNING_SERVER_TOKEN"]
        client = ServerClient(args.url, token=token, timeout=600)
        results |= time_transfers(client, model, args, token, transfer_dir=args.transfer_dir)
    else:
        token = secrets.token_urlsafe(32)
        with tempfile.TemporaryDirectory(prefix="bench_transfer_") as tmp:
            spec = ServerSpec(port=free_ports(1)[0], cpus=str(args.engine_cpu))
            with LaunchedServers(model_dir, [spec], log_dir=Path(tmp), token=token) as servers:
                client = ServerClient(servers.urls[0], token=token, timeout=600)
                results |= time_transfers(client, model, args, token, transfer_dir=None)
    pack_s = time_packing(model, token, args.chunk_mb << 20, args.pushes)
    results["network"]["pack_and_digest_alone_s"] = pack_s
    results["digest_bytes_per_s"] = digest_rate()
    results["projection_7b_bf16"] = projection(results["network"]["bytes"] / pack_s, results["digest_bytes_per_s"])
    print_table(results)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return results


def time_transfers(client: ServerClient, model, args, token: str, transfer_dir: str | None) -> dict:
    """Both transfers' pushes to the server ``client`` reaches: files (in ``transfer_dir``, None: shared memory on
    this host), then the network from this host's address on the route to it."""
    from stare_lightning.rollout.server.shared.net_group import route_address
    from stare_lightning.rollout.server.trainer_side.engine import ServerRolloutEngine
    from stare_lightning.rollout.server.trainer_side.net_push import NetworkPush
    from stare_lightning.rollout.server.trainer_side.placement import server_host

    chunk_bytes, results = args.chunk_mb << 20, {}
    files = ServerRolloutEngine([client], chunk_bytes=chunk_bytes, transfer_dir=transfer_dir)
    try:
        results["files"] = time_pushes(files, model, args.pushes)
    finally:
        files.close()
    address = route_address(server_host(client.url) or "127.0.0.1")
    network = NetworkPush([client], token=token, address=address, port=0, timeout=600)
    over_network = ServerRolloutEngine([client], chunk_bytes=chunk_bytes, network=network)
    try:
        results["network"] = time_pushes(over_network, model, args.pushes)
    finally:
        over_network.close()
    return results


def print_table(results: dict) -> None:
    print("\n| transfer | push (median) | range | bytes | bytes/s |\n|---|---|---|---|---|")
    for name in ("files", "network"):
        row = results[name]
        low, high = row["push_range_s"]
        print(
            f"| {name} | {row['push_median_s']:.3f} s | {low:.3f}-{high:.3f} s | {row['bytes'] / 1e6:.0f} MB | "
            f"{row['bytes_per_s'] / 1e6:.0f} MB/s |"
        )
    pack_s, rate = results["network"]["pack_and_digest_alone_s"], results["digest_bytes_per_s"]
    print(f"\nnetwork: packing with digests alone {pack_s:.3f} s; HMAC-SHA256 {rate / 1e9:.2f} GB/s on one core")
    print("\n| 7B bf16 | pack + digest | wire | server digest | push (no overlap) |\n|---|---|---|---|---|")
    for row in results["projection_7b_bf16"]:
        print(
            f"| {row['link_gbit']} Gb/s | {row['pack_s']:.1f} s | {row['wire_s']:.1f} s | "
            f"{row['server_digest_s']:.1f} s | {row['push_s']:.1f} s |"
        )


if __name__ == "__main__":
    main()
