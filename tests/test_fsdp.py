"""Sharded training with FSDP2 on two CPU processes (gloo) against an unsharded one-process run.

Every run sees the same global batch of prompts (8 per step: 8 on one rank, or 4 on each of two), and
rollouts are seeded per prompt, so the runs must sample the same responses and take the same optimizer
steps: losses, STARE's step-wide selection and the final weights agree up to float summation order. With
HF rollouts the two-process run is launched three ways: by Lightning (and stopped after its step-2
distributed checkpoint, then resumed), by torchrun as two single-process nodes, and by ``sbatch
scripts/slurm_fit.sh`` on two nodes of a real SLURM cluster on this machine (``scripts/cluster.sh``: each node its own
network, hostname, ``/tmp`` and ``/dev/shm``). The Lightning launch with vLLM rollouts is compared with the colocated
reference fit of tests/test_fit_server.py, which shares it.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.cluster import signal_each, slurm_cluster
from tests.test_fit import FAST, REPO, read_metrics, run_cli, train_rows

# One xdist worker runs this module: its tests share the one-process reference fit (a module fixture).
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("fsdp")]

# Gate forced on (target entropy above any entropy here) so the selection shapes the loss; dynamic sampling
# on (stare_o1's default): it filters the global batch, so it too must not depend on the sharding.
SAME_STEPS = [
    *FAST,
    "algorithm=stare_o1",
    "algorithm.stare.target_entropy=10.0",
    "algorithm.collection.dynamic_sampling=true",
    "trainer.precision=32-true",
    "validation.before_fit=false",
    "trainer.val_check_interval=100",
    "callbacks.model_checkpoint.every_n_train_steps=2",
    "trainer.max_steps=3",
    # The padded layout (the default is packed): the packed FSDP2 fit below is compared against it.
    "forward.packed_sequences=false",
    "forward.share_prompts=false",
]
ONE_PROCESS = [*SAME_STEPS, "trainer=cpu", "data.prompts_per_step=8"]
# Everything but the launch: trainer=fsdp, devices and nodes come from the launcher's command line.
SHARDED = [*SAME_STEPS, "trainer.accelerator=cpu", "trainer.strategy.param_dtype=null", "data.prompts_per_step=4"]
COMPARED = [
    "loss",
    "pg_loss",
    "entropy",
    "reward/mean",
    "grad_norm",
    "response_length/mean",
    "stare/selected_frac/pos",
    "stare/selected_frac/neg",
    "quadrant/exact/pos_high/tokens",
]


def _fit(args, model_cache, cwd):
    proc = run_cli(["fit", *args], model_cache, cwd=cwd)
    out, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, out[-4000:]


def _export(run, export_dir, model_cache, cwd):
    proc = run_cli(
        [
            "export",
            f"output_dir={run}",
            f"ckpt_path={run / 'checkpoints' / 'last.ckpt'}",
            f"export_dir={export_dir}",
            *FAST,
        ],
        model_cache,
        cwd=cwd,
    )
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-4000:]
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(export_dir).state_dict()


def _assert_same_steps(expected_run, got_run, num_steps=3):
    expected, got = train_rows(read_metrics(expected_run)), train_rows(read_metrics(got_run))
    assert sorted(got) == sorted(expected) and len(expected) == num_steps
    for step in expected:
        for name in COMPARED:
            want, have = expected[step][f"train/{name}"], got[step][f"train/{name}"]
            # nan_ok: a share over no nonzero-advantage token (every group filtered out) is NaN in both runs.
            assert have == pytest.approx(want, abs=1e-5, rel=1e-5, nan_ok=True), f"step {step}: train/{name}"
        # The step-wide top-10% selection is a count over all ranks' tokens: it must match exactly.
        for name in ("stare/selected_frac/pos", "stare/selected_frac/neg"):
            assert got[step][f"train/{name}"] == expected[step][f"train/{name}"], f"step {step}: train/{name}"
    assert any(expected[step]["train/stare/selected_frac/pos"] > 0 for step in expected)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, model_cache):
    run = tmp_path_factory.mktemp("fsdp") / "one_process"
    _fit([f"output_dir={run}", *ONE_PROCESS], model_cache, run.parent)
    return run


def test_two_process_fsdp_fit_matches_one_process_and_resumes(reference, tmp_path, model_cache):
    sharded = tmp_path / "fsdp"
    launch = ["trainer=fsdp", "trainer.devices=2"]
    _fit([f"output_dir={sharded}", *SHARDED, *launch, "trainer.max_steps=2"], model_cache, tmp_path)
    checkpoint = sharded / "checkpoints" / "last.ckpt"
    assert checkpoint.is_dir(), "ModelParallelStrategy should write a distributed checkpoint directory"
    _fit([f"output_dir={sharded}", *SHARDED, *launch, f"ckpt_path={checkpoint}"], model_cache, tmp_path)
    _assert_same_steps(reference, sharded)  # step 2 comes from the resumed run

    want = _export(reference, tmp_path / "hf_one_process", model_cache, tmp_path)
    have = _export(sharded, tmp_path / "hf_fsdp", model_cache, tmp_path)
    assert want.keys() == have.keys()
    # Two ranks sum the gradients in another order than one process (about 1e-7 relative); Adam divides each
    # element by its own second moment, which lifts that to about 1e-5 on an odd element after three steps.
    atol = 2e-5
    for name in want:
        torch.testing.assert_close(have[name], want[name], atol=atol, rtol=0, msg=lambda m, n=name: f"{n}: {m}")
    # Both runs trained: the weights moved away from their common start by far more than the tolerance.
    from transformers import AutoModelForCausalLM

    last = torch.load(reference / "checkpoints" / "last.ckpt", weights_only=False)
    assert last["global_step"] == 3, "last.ckpt must hold the final step, not the last periodic save (step 2)"
    start = AutoModelForCausalLM.from_pretrained(last["hyper_parameters"]["model_dir"]).state_dict()
    assert max((want[name] - start[name]).abs().max().item() for name in want) > 25 * atol


def test_two_process_ppo_mini_batches_match_one_process(tmp_path, model_cache):
    """Two optimizer steps per rollout batch: the mini-batches are split over the global batch, not per rank."""
    # max_steps counts optimizer steps: 2 rollout batches x 2 epochs x 2 mini-batches.
    ppo = ["algorithm.update.mini_batches=2", "algorithm.update.ppo_epochs=2", "trainer.max_steps=8"]
    one, two = tmp_path / "one_process", tmp_path / "fsdp"
    _fit([f"output_dir={one}", *ONE_PROCESS, *ppo], model_cache, tmp_path)
    _fit([f"output_dir={two}", *SHARDED, "trainer=fsdp", "trainer.devices=2", *ppo], model_cache, tmp_path)
    _assert_same_steps(one, two, num_steps=2)


def test_two_process_packed_fused_fsdp_fit_matches_the_padded_one_process_fit(reference, tmp_path, model_cache):
    """Packed micro-batches with shared prompts and the fused LM head under FSDP2: the head's weight is read after
    the root's forward has gathered it, and the backward reduce-scatters its gradient (grad_norm would show a
    rank's local gradient); every step is the padded one-process run's."""
    layout = ["forward.packed_sequences=true", "forward.share_prompts=true", "forward.fused_lm_head=true",
              "telemetry.same_batch_entropy=false"]  # fmt: skip
    sharded = tmp_path / "fsdp_packed_fused"
    _fit([f"output_dir={sharded}", *SHARDED, "trainer=fsdp", "trainer.devices=2", *layout], model_cache, tmp_path)
    _assert_same_steps(reference, sharded)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_two_node_torchrun_launch_matches_one_process(reference, tmp_path, model_cache):
    run = tmp_path / "torchrun"
    env = {
        **os.environ,
        "STARE_LIGHTNING_CACHE": model_cache,
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": "1",
    }
    node = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=2",
        "--nproc-per-node=1",
        "--master-addr=127.0.0.1",
        f"--master-port={_free_port()}",
    ]
    args = ["-m", "stare_lightning", "fit", "trainer=fsdp", "trainer.devices=1", "trainer.num_nodes=2"]
    procs = [
        subprocess.Popen(
            [*node, f"--node-rank={rank}", *args, f"output_dir={run}", *SHARDED],
            cwd=tmp_path,
            env=env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for rank in (0, 1)
    ]
    outputs = [proc.communicate(timeout=900)[0] for proc in procs]
    assert all(proc.returncode == 0 for proc in procs), "\n".join(out[-3000:] for out in outputs)
    _assert_same_steps(reference, run)


def _logged_steps(run) -> set[int]:
    """The training steps rank 0 has written to ``metrics.csv`` so far (none while the file is being rewritten)."""
    try:
        return set(train_rows(read_metrics(run)))
    except (OSError, ValueError, KeyError, TypeError):  # a row cut short reads as None
        return set()


@pytest.fixture(scope="module")
def cluster():
    with slurm_cluster("fsdp", 1, nodes=2) as nodes:
        yield nodes


def test_slurm_fit_on_two_real_nodes_survives_a_lost_rank_and_matches_one_process(
    reference, cluster, tmp_path, model_cache
):
    """``sbatch scripts/slurm_fit.sh`` as its header asks, on CPU nodes (``--gpus-per-node=0``): one rank a node,
    meeting over the cluster network. The rank on node2 is killed after the step-2 checkpoint and step 1's metrics;
    the job ends, and the same job resubmitted with ``ckpt_path=last`` finishes with the one-process run's steps and
    final weights."""
    cluster.copy_models(model_cache)
    run = cluster.shared / "slurm_fit"
    job = ["--nodes=2", "--gpus-per-node=0", str(REPO / "scripts" / "slurm_fit.sh"), *SHARDED, f"output_dir={run}"]
    first = cluster.submit(*job, cwd=cluster.shared)
    # Complete once Lightning's own state (meta.pt, rank 0) follows the shards' index (.metadata, all ranks).
    checkpoint = [run / "checkpoints" / "last.ckpt" / name for name in (".metadata", "meta.pt")]
    deadline = time.time() + 900
    rank = []  # node2's rank, found while the job starts, so that the kill follows the checkpoint within milliseconds
    while not rank and cluster.active(first, cluster.shared):
        assert time.time() < deadline, "node2's rank did not start within 900 s"
        rank = cluster.pids("node2", "-m stare_lightning fit")
        time.sleep(0.2)
    assert len(rank) == 1, rank
    # After the checkpoint's files Lightning holds every rank at a barrier, and only then logs the step's metrics
    # (rank 0). A kill before that row loses it for good (the resumed job starts at step 2): wait for it too.
    while not (all(p.exists() for p in checkpoint) and 1 in _logged_steps(run)) and Path(f"/proc/{rank[0]}").exists():
        assert time.time() < deadline, "no step-2 checkpoint after 900 s"
        time.sleep(0.01)
    assert signal_each(rank, signal.SIGKILL) == 1
    lost = cluster.wait(first, cluster.shared)
    assert lost.state == "FAILED" and lost.nodes == "node[1-2]", lost.output[-4000:]
    # Killed before the run's end: no checkpoint of its final state (step 3); rank 0 may have logged step 2's metrics.
    assert not list((run / "checkpoints").glob("*step=3*")), "the job finished before its rank could be killed"

    resumed = cluster.sbatch(*job, "ckpt_path=last", cwd=cluster.shared)
    assert resumed.state == "COMPLETED", resumed.output[-4000:]
    _assert_same_steps(reference, run)  # step 2 comes from the resubmitted job
    want = _export(reference, tmp_path / "hf_one_process", model_cache, tmp_path)
    have = _export(run, tmp_path / "hf_cluster", model_cache, tmp_path)
    assert want.keys() == have.keys()
    for name in want:  # the tolerance of the two-process test above, for the same reason
        torch.testing.assert_close(have[name], want[name], atol=2e-5, rtol=0, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize(
    "trainer_kwargs,expected",
    [
        ({"precision": "32-true"}, torch.float32),
        ({"precision": "bf16-mixed"}, torch.bfloat16),
        ({"precision": "32-true", "strategy": "fsdp2_bf16"}, torch.bfloat16),
        ({"precision": "32-true", "strategy": "fsdp2_fp32"}, torch.float32),
    ],
)
def test_rollout_engine_computes_in_the_trainers_dtype(trainer_kwargs, expected, tiny_dir):
    """vLLM is built in the dtype the trainer's forward runs in, not the fp32 master weights' dtype."""
    import lightning
    from transformers import AutoModelForCausalLM

    from stare_lightning.trainer import FSDP2Strategy
    from stare_lightning.trainer.precision import compute_dtype

    kwargs = dict(trainer_kwargs, accelerator="cpu", devices=1, logger=False)
    if "strategy" in kwargs:
        kwargs["strategy"] = FSDP2Strategy(param_dtype="bfloat16" if kwargs["strategy"] == "fsdp2_bf16" else None)
    trainer = lightning.Trainer(**kwargs)
    policy = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    assert compute_dtype(trainer.strategy, trainer.precision, policy) == expected
