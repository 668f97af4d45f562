"""``rollout=server`` end to end, with real vLLM server processes: the same steps as the colocated engine, with the
weights pushed through files and over the network; on a SLURM cluster of namespaces (``tests/cluster.py``), the
servers recipe, a LoRA run sending its adapters, a lost rollout node, a cut link, and a stranger to the secret;
asynchronous steps (``rollout.max_staleness=2``) lagging by exactly their bound and equal over one rank on one host
and two nodes started by hand (two servers, by URL); a server that dies mid-run ending the run with one line, its
checkpoint intact and resumable (the resumed run pushes its weights to a fresh server before sampling); servers
started elsewhere with ``serve``. The colocated reference fit is also the one-process side of the two-process FSDP2
fit with colocated vLLM engines."""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stare_lightning.rollout.server.trainer_side.client import RolloutServerError, ServerClient
from stare_lightning.rollout.server.trainer_side.connect import connect_servers
from stare_lightning.rollout.server_config import ServerConfig
from tests.cluster import slurm_cluster
from tests.test_fit import CANARY_BOUND, REPO, read_metrics, run_cli, train_rows, wait_for_checkpoint
from tests.test_fsdp import ONE_PROCESS, SHARDED, _assert_same_steps, _fit

pytestmark = [pytest.mark.slow, pytest.mark.vllm]
# One xdist worker runs the tests that share the colocated reference fit, the other may take the fault tests.
SHARES_THE_REFERENCE = pytest.mark.xdist_group("server")
FAULTS = pytest.mark.xdist_group("server_faults")
# Every step's samples in rollouts.jsonl, to compare them between engines.
DUMP = ["+callbacks.sample_dump={_target_:stare_lightning.callbacks.RolloutSampleDump,every_n_steps:1,max_groups:8}"]
# The sharded fit's settings for processes on the cluster's nodes, which reach their servers (rollout=server).
ON_NODES = [arg for arg in SHARDED if arg != "rollout=hf"]


def _samples(run: Path) -> list[list[str]]:
    return [record["responses"] for record in map(json.loads, (run / "rollouts.jsonl").read_text().splitlines())]


@pytest.fixture(scope="module")
def colocated(tmp_path_factory, model_cache):
    run = tmp_path_factory.mktemp("server") / "colocated"
    _fit([f"output_dir={run}", *ONE_PROCESS, *DUMP, "rollout=vllm"], model_cache, run.parent)
    return run


@SHARES_THE_REFERENCE
def test_a_server_fit_takes_the_colocated_fits_steps(colocated, tmp_path, model_cache):
    run = tmp_path / "server"
    _fit([f"output_dir={run}", *ONE_PROCESS, *DUMP, "rollout=server"], model_cache, tmp_path)
    _assert_same_steps(colocated, run)
    assert _samples(run) == _samples(colocated) and _samples(run)  # the same samples, drawn by another process
    for fit in (colocated, run):  # each engine got the trainer's weights: its log-probs are the trainer's (fp32)
        assert all(
            r["train/rollout/logprob_abs_diff/mean"] < CANARY_BOUND for r in train_rows(read_metrics(fit)).values()
        )
    assert list((run / "servers").glob("server-*.log"))  # the launched server's log is in the run directory


@SHARES_THE_REFERENCE
def test_two_process_fsdp_with_vllm_rollouts_matches_one_process(colocated, tmp_path, model_cache):
    """The default backend: each rank's colocated vLLM engine samples its prompts as one engine would all."""
    two = tmp_path / "fsdp"
    _fit([f"output_dir={two}", *SHARDED, "trainer=fsdp", "trainer.devices=2", "rollout=vllm"], model_cache, tmp_path)
    _assert_same_steps(colocated, two)


@pytest.fixture(scope="module")
def cluster():
    with slurm_cluster("servers", 2, nodes=3) as nodes:
        yield nodes


@SHARES_THE_REFERENCE
def test_the_slurm_servers_recipe_on_three_nodes_takes_the_colocated_fits_steps(colocated, cluster, model_cache):
    """``sbatch scripts/slurm_servers.sh`` on CPU nodes of a real scheduler: ``serve`` on node1, a two-node FSDP2
    trainer on node2 and node3 whose ranks meet at node2 (its step's first node, not the job's), reaching the server
    over the cluster network, and its weights too (nothing shared but the output directory); the colocated engine's
    samples and steps."""
    cluster.copy_models(model_cache)
    run = cluster.shared / "servers"
    script = str(REPO / "scripts" / "slurm_servers.sh")
    job = cluster.sbatch(
        "--nodes=3", "--gpus-per-node=0", script, *ON_NODES, *DUMP, cwd=cluster.shared, env={"OUTPUT_DIR": str(run)}
    )
    assert job.state == "COMPLETED" and job.nodes == "node[1-3]", job.output[-4000:]
    assert "weights go to 1 rollout server(s) over the network (gloo, rendezvous at " in job.output
    assert not (run / "weights").exists()
    _assert_same_steps(colocated, run)
    # Rank 0 dumps its own half of each step's groups: every one is the colocated engine's, token for token.
    ours, theirs = _samples(run), _samples(colocated)
    assert len(ours) == len(theirs) // 2 and all(group in theirs for group in ours)
    rows = train_rows(read_metrics(run)).values()
    assert all(row["train/rollout/logprob_abs_diff/mean"] < CANARY_BOUND for row in rows)
    assert list((run / "rollout" / "node1" / "servers").glob("server-*.log"))  # the server ran on node1


@SHARES_THE_REFERENCE
def test_a_rollout_node_lost_mid_run_ends_the_slurm_job_in_one_line(cluster, model_cache):
    """A LoRA policy trains on node2-3 with adapter-only sync: each version's adapter reaches node1 inside its load
    request (no directory both see) and is served from the server's own checked copy. Then the vLLM server on node1
    is killed after the step-2 checkpoint: the trainer ends within its request timeout, each line it prints naming
    the server, and the job fails instead of hanging. With one rollout node the run cannot go on; its checkpoint is
    intact for a resubmission (the resume itself is tested above)."""
    cluster.copy_models(model_cache)
    run = cluster.shared / "servers_lost"
    script = str(REPO / "scripts" / "slurm_servers.sh")
    long_run = ["trainer.max_steps=50", "rollout.server.request_timeout=60"]
    lora = ["model.lora.rank=4", "rollout.lora_sync=adapter"]
    job = cluster.submit(
        "--nodes=3",
        "--gpus-per-node=0",
        script,
        *ON_NODES,
        *long_run,
        *lora,
        cwd=cluster.shared,
        env={"OUTPUT_DIR": str(run)},
    )
    checkpoint = run / "checkpoints" / "last.ckpt" / ".metadata"
    deadline = time.time() + 900
    while not checkpoint.exists() and cluster.active(job, cluster.shared):
        assert time.time() < deadline, "no step-2 checkpoint after 900 s"
        time.sleep(0.2)
    assert cluster.kill("node1", "vllm.entrypoints.openai.api_server") >= 1
    killed = time.monotonic()
    lost = cluster.wait(job, cluster.shared)
    assert lost.state == "FAILED", lost.output[-4000:]
    assert time.monotonic() - killed < 240  # the request timeout (60 s) plus the teardown, never a hang
    # A rank waiting on the server names it; a rank left at a collective says its peer ended (or is stopped first).
    errors = [line for line in lost.output.splitlines() if line.startswith("error:")]
    named = [line for line in errors if "rollout server http://node1:8000" in line]
    # One line a trainer rank at most: each rank that was waiting on the server names it (timing decides how many).
    assert 1 <= len(named) <= 2 and "Traceback" not in lost.output, lost.output[-4000:]
    # serve on node1 says its server died; no other error.
    known = ("rollout server", "another rank of this run ended")
    assert all(any(part in line for part in known) for line in errors), "\n".join(errors)
    assert checkpoint.exists()
    # Before the loss the adapters went inside their load requests, and the steps up to the checkpoint sampled with
    # them: every request named its version's adapter, which node1 answers only once it has loaded it (else 404).
    assert "adapters go to 1 rollout server(s) inside their load requests" in lost.output


# How long each side of the stranger test waits for the other to join: both join once their imports are done, so the
# control meets well within it; the stranger's case waits it out.
JOIN_TIMEOUT_S = 8.0
# The trainer's side of a network push on node2 (argv: secret, peer, timeout): hosts the rendezvous store on its cluster
# address, prints where, and on a line from stdin joins member 0's group under the secret's prefix and sends one chunk.
NET_TRAINER = """
import json, sys, torch
from stare_lightning.rollout.server.shared.net_group import TRAINER_RANK, TransferGroup, host_store, route_address
from stare_lightning.rollout.server.shared.net_wire import new_nonce, pack_chunks, rendezvous_prefix
token, peer, timeout = sys.argv[1], sys.argv[2], float(sys.argv[3])
((info, buffer),) = pack_chunks([("a.weight", torch.arange(12.0).reshape(3, 4))], token, chunk_bytes=1 << 20)
address = route_address(peer)
store, nonce = host_store(address, 0, timeout), new_nonce()
print(json.dumps({"address": address, "port": store.port, "nonce": nonce, "info": info}), flush=True)
sys.stdin.readline()
try:
    TransferGroup(store, rendezvous_prefix(token, nonce, 0), TRAINER_RANK, address, timeout).send(buffer)
    print("sent")
except RuntimeError as error:
    print("not met:", str(error).splitlines()[0])
"""
# A server's worker on another host: joins the group the init names with its own secret and prints what arrived.
NET_WORKER = """
import json, sys
from stare_lightning.rollout.server.in_vllm.net_receive import NetworkReceiver
init, info = json.loads(sys.argv[1]), json.loads(sys.argv[2])
print("ready", flush=True)
sys.stdin.readline()
try:
    print(json.dumps({name: t.tolist() for name, t in NetworkReceiver(init).receive(info)[1].items()}))
except Exception as error:
    print(json.dumps({"refused": str(error)}))
"""


def _first_line(proc: subprocess.Popen, prefix: str) -> str:
    """The first line ``proc`` prints that starts with ``prefix`` (torch's warnings come first on a cluster host)."""
    while line := proc.stdout.readline():
        if line.startswith(prefix):
            return line.strip()
    raise AssertionError(f"the process ended (status {proc.wait()}) before printing a line starting {prefix!r}")


@SHARES_THE_REFERENCE
@pytest.mark.parametrize("knows_the_secret", [True, False])
def test_a_host_without_the_secret_cannot_join_the_weight_transfer_group(cluster, knows_the_secret):
    """A fourth host on the cluster network, not a SLURM node, knows the trainer's address, port and nonce (all the
    init request carries) but not the run's secret: it never joins the group and receives nothing, and the trainer's
    join times out. The control: the same process with the secret receives the trainer's bytes."""
    if "stranger" not in cluster.script("status").stdout:
        cluster.script("host", "stranger")
    token = "cluster-run-secret-" + "0123456789" * 3
    trainer = cluster.popen("node2", sys.executable, "-c", NET_TRAINER, token, "stranger", str(JOIN_TIMEOUT_S))
    where = json.loads(_first_line(trainer, "{"))
    init = {key: where[key] for key in ("address", "port", "nonce")} | {"member": 0, "timeout_s": JOIN_TIMEOUT_S}
    secret = token if knows_the_secret else "a-guess-at-the-secret-" + "x" * 20
    job = [sys.executable, "-c", NET_WORKER, json.dumps(init), json.dumps(where["info"])]
    worker = cluster.popen("stranger", *job, env={"STARE_LIGHTNING_SERVER_TOKEN": secret})
    assert _first_line(worker, "ready") == "ready"
    for proc in (trainer, worker):  # both told at once: each blocks until the other joins (or its timeout)
        proc.stdin.write("go\n")
        proc.stdin.flush()
    outputs = [proc.communicate(timeout=180)[0].splitlines() for proc in (trainer, worker)]
    answers = [[line for line in lines if line.startswith(("sent", "not met", "{"))][-1] for lines in outputs]
    got = json.loads(answers[1])
    if knows_the_secret:
        assert answers[0] == "sent" and got == {"a.weight": [[float(4 * r + c) for c in range(4)] for r in range(3)]}
    else:
        assert answers[0].startswith("not met:") and "joining the trainer's weight-transfer group" in got["refused"]


# Samples up to two versions old, and a validation after step 2 (the producer drains, the servers get the current
# weights, then the producer goes on).
ASYNC = ["rollout=server", "rollout.max_staleness=2", "trainer.val_check_interval=2"]


@pytest.fixture(scope="module")
def served_by_hand(cluster, model_cache):
    """``serve`` started by hand on node1, no scheduler: two servers listening on the cluster network (ports 8000 and
    8001) behind a secret of the test's; their URLs and the secret."""
    cluster.copy_models(model_cache)
    token = secrets.token_urlsafe(32)
    listen = ["rollout.server.host=0.0.0.0", "rollout.server.port=8000", "rollout.server.count=2"]
    args = ["serve", "trainer=fsdp", *ON_NODES, *ASYNC, *listen, f"output_dir={cluster.shared / 'by_hand'}"]
    serve = cluster.popen("node1", sys.executable, "-m", "stare_lightning", *args, env=_node_env(cluster, token))
    printed = []
    try:
        for line in serve.stdout:  # bounded by the launcher's own startup timeout
            printed.append(line)
            if line.startswith("rollout servers: "):
                break
        assert printed and printed[-1].startswith("rollout servers: "), "".join(printed)[-4000:]
        yield ["http://node1:8000", "http://node1:8001"], token
    finally:
        cluster.kill("node1", "stare_lightning serve", signal.SIGTERM)
        serve.communicate(timeout=120)


def _node_env(cluster, token: str) -> dict[str, str]:
    return {**cluster.env, "STARE_LIGHTNING_SERVER_TOKEN": token}


def _by_url(urls: list[str]) -> list[str]:
    return ["rollout=server", "rollout.server.launch=false", f"rollout.server.urls=[{','.join(urls)}]"]


@SHARES_THE_REFERENCE
def test_async_steps_lag_by_at_most_k_and_two_nodes_by_hand_take_the_same_steps(
    colocated, served_by_hand, cluster, tmp_path, model_cache
):
    one = tmp_path / "async_one_rank"
    _fit([f"output_dir={one}", *ONE_PROCESS, *ASYNC], model_cache, tmp_path)
    rows = train_rows(read_metrics(one))
    assert [rows[step]["train/async/staleness/max"] for step in sorted(rows)] == [0.0, 1.0, 2.0]
    # The stale batches really come from older weights: the fresh one is within the canary's bound, they are not.
    gaps = [rows[step]["train/rollout/logprob_abs_diff/mean"] for step in sorted(rows)]
    assert gaps[0] < CANARY_BOUND < min(gaps[1:]), gaps
    assert any(key.startswith("val/") for row in read_metrics(one) for key in row)  # the validation ran
    # The first batch comes from the starting weights, as in the synchronous fit.
    first = min(rows)
    assert rows[first]["train/loss"] == pytest.approx(train_rows(read_metrics(colocated))[first]["train/loss"])
    # Another layout on other hosts, other timings: `serve` started by hand on node1 with two servers, and a fit on
    # node2 and node3 started by torchrun (no scheduler) reaching them by URL, its weights over the network and
    # nothing shared but the run directory. The same versions generate the same samples, so the same steps follow.
    urls, token = served_by_hand
    two = cluster.shared / "async_two_nodes"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1"]
    torchrun += ["--master-addr=node2", "--master-port=29500"]
    fit = ["-m", "stare_lightning", "fit", "trainer=fsdp", "trainer.devices=1", "trainer.num_nodes=2"]
    fit += [*ON_NODES, *ASYNC, *_by_url(urls), f"output_dir={two}"]
    env = _node_env(cluster, token)
    procs = [
        cluster.popen(node, *torchrun, f"--node-rank={i}", *fit, env=env) for i, node in enumerate(["node2", "node3"])
    ]
    outputs = [proc.communicate(timeout=900)[0] for proc in procs]
    assert all(proc.returncode == 0 for proc in procs), "\n".join(out[-3000:] for out in outputs)
    assert "weights go to 2 rollout server(s) over the network (gloo, rendezvous at " in outputs[0]
    assert not (two / "weights").exists()
    _assert_same_steps(one, two)
    rows = train_rows(read_metrics(two))
    assert [rows[step]["train/async/staleness/max"] for step in sorted(rows)] == [0.0, 1.0, 2.0]


@SHARES_THE_REFERENCE
def test_a_link_cut_mid_push_ends_the_run_in_one_line_and_the_server_keeps_its_weights(served_by_hand, cluster):
    """node1's link is slowed to 1 Mbit/s (a push of the tiny model then takes about 18 s) and pulled out 2 s into
    a fit's first push from node2: the fit ends within its request timeout with one line naming the server, and the
    server, once the link is back, still serves the version it had."""
    urls, token = served_by_hand
    client = ServerClient(f"http://{cluster.subnet}.1:8000", token=token, timeout=60)  # node1, from this machine
    before = client.weight_version()
    run = cluster.shared / "link_cut"
    args = ["fit", *ONE_PROCESS, *_by_url(urls[:1]), "rollout.server.request_timeout=20", f"output_dir={run}"]
    cluster.script("shape", "node1", "1mbit")
    printed = []
    try:
        fit = cluster.popen("node2", sys.executable, "-m", "stare_lightning", *args, env=_node_env(cluster, token))
        for line in fit.stdout:
            printed.append(line)
            if "over the network (gloo, rendezvous at" in line:
                break
        time.sleep(2)
        cluster.script("link", "node1", "down")
        cut = time.monotonic()
        printed.append(fit.communicate(timeout=300)[0])
        ended = time.monotonic() - cut
    finally:
        cluster.script("link", "node1", "up")
        cluster.script("shape", "node1", "off")
    out = "".join(printed)
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert fit.returncode != 0 and len(errors) == 1 and "Traceback" not in out, out[-4000:]
    assert "rollout server http://node1:8000" in errors[0] and "within 20 s" in errors[0], errors
    assert ended < 20 + 30  # the request timeout, and the run's teardown
    assert client.weight_version() == before  # the cut round never swapped


def _server_pids(log_dir: Path) -> list[int]:
    """The launched servers' process ids, found by the address each one's log names on its first line (a Unix
    socket's path, or a TCP port). A CPU server's engine core, forked, has its command line too: it is left out."""
    addresses = set()
    for log in log_dir.glob("server-*.log"):
        url = log.read_text().splitlines()[0].removeprefix("# rollout server ")
        addresses.add(
            ("--uds", url.removeprefix("unix:")) if url.startswith("unix:") else ("--port", url.split(":")[-1])
        )
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        if b"vllm.entrypoints.openai.api_server" not in argv:
            continue
        for flag, value in addresses:
            if flag.encode() in argv and argv[argv.index(flag.encode()) + 1].decode() == value:
                pids.append(int(proc.name))
    return [pid for pid in pids if _parent(pid) not in pids]


def _parent(pid: int) -> int | None:
    try:  # the field after the command's name, which is in parentheses and may hold spaces
        return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1])
    except (OSError, ValueError):
        return None


@FAULTS
def test_a_server_that_dies_ends_the_run_in_one_line_and_the_run_resumes(tmp_path, model_cache):
    """With asynchronous steps (K = 1): the producer's failure reaches the trainer as one line; the resumed run starts
    its producer afresh from the checkpoint's weights (its first batch is not stale)."""
    run = tmp_path / "dies"
    args = [
        f"output_dir={run}", *ONE_PROCESS, "rollout=server", "rollout.max_staleness=1",
        "rollout.server.request_timeout=60", "callbacks.model_checkpoint.every_n_train_steps=1",
        "trainer.max_steps=50",
    ]  # fmt: skip
    proc = run_cli(["fit", *args], model_cache, cwd=tmp_path)
    wait_for_checkpoint(proc, run / "checkpoints" / "last.ckpt")
    pids = _server_pids(run / "servers")
    assert len(pids) == 1
    os.killpg(os.getpgid(pids[0]), signal.SIGKILL)
    killed = time.monotonic()
    out, _ = proc.communicate(timeout=300)  # the request timeout (60 s) plus the run's teardown, never a hang
    assert proc.returncode != 0
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "rollout server unix:/" in errors[0], out[-3000:]
    assert time.monotonic() - killed < 240
    steps_done = max(train_rows(read_metrics(run)))
    assert steps_done < 49
    resumed = [*args[:-1], f"trainer.max_steps={steps_done + 3}", "ckpt_path=last"]  # two steps or more
    _fit(resumed, model_cache, tmp_path)
    assert max(train_rows(read_metrics(run))) > steps_done  # it trained on from the checkpoint
    # In the log's order: the resumed run starts where the step count goes back (or past the killed run's last step).
    logged = [(int(r["step"]), r["train/async/staleness/max"]) for r in read_metrics(run) if "train/entropy" in r]
    start = next(i for i in range(1, len(logged)) if logged[i][0] <= logged[i - 1][0] or logged[i][0] > steps_done)
    lags = [lag for _, lag in logged[start:]]
    assert lags[0] == 0.0 and lags[1:] and all(lag == 1.0 for lag in lags[1:]), logged


@FAULTS
def test_a_run_uses_servers_started_elsewhere_with_serve(tmp_path, model_cache, monkeypatch):
    """``serve`` on a "rollout node" (on a Unix socket, its default) makes the credential and writes it to a file of
    mode 0600, printing the file's path, never the token; a fit without the credential stopped before its first step
    naming the variable; one reaching it by URL with the credential from the file; one whose update overflows,
    stopped before its weights reach the server; then Ctrl-C's signal."""
    monkeypatch.delenv("STARE_LIGHTNING_SERVER_TOKEN", raising=False)
    # No cold start: each fit pushes its own weights before its first sample, so what serve loads is a shape only.
    serve = ["serve", "rollout=server", f"output_dir={tmp_path / 'node'}", "model.cold_start.steps=0"]
    server = run_cli(serve, model_cache, cwd=tmp_path)
    printed, token = [], None
    try:
        url = None
        for line in server.stdout:  # bounded by the launcher's own startup timeout
            printed.append(line)
            if line.startswith("rollout servers: "):
                url = line.split()[2]
                break
        assert url and url.startswith("unix:/"), "serve did not report its server"
        token_file = tmp_path / "node" / "server-token"
        assert any(f"the servers' credential is in {token_file} (mode 0600)" in line for line in printed), printed
        assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
        token = token_file.read_text().strip()
        assert len(token) >= 32
        run = tmp_path / "trainer"
        urls = ["rollout=server", "rollout.server.launch=false", f"rollout.server.urls=[{url}]"]
        # Without the credential the trainer stops before its first step, naming the variable to set.
        refused = ServerConfig(launch=False, urls=[url])
        with pytest.raises(
            RolloutServerError, match=r"refused the run's credential: \$STARE_LIGHTNING_SERVER_TOKEN is unset"
        ):
            connect_servers(refused, "unused", dtype="float32", seed=0, log_dir=tmp_path)
        monkeypatch.setenv("STARE_LIGHTNING_SERVER_TOKEN", token)  # as `export ...=$(cat server-token)` does
        proc = run_cli(
            ["fit", f"output_dir={run}", *ONE_PROCESS, *urls, "trainer.max_steps=2"], model_cache, cwd=tmp_path
        )
        out, _ = proc.communicate(timeout=900)
        assert proc.returncode == 0, out[-3000:]
        assert not (run / "servers").exists()  # nothing launched by the trainer
        # An update that overflows (AdamW at lr 1e39 makes every weight inf or NaN): the run stops in one line naming
        # the tensor and the step, writes no checkpoint of it, and the server keeps the weights it had.
        diverged = tmp_path / "diverged"
        args = ["fit", f"output_dir={diverged}", *ONE_PROCESS, *urls, "trainer.max_steps=2", "optim.lr=1e39",
                "callbacks.model_checkpoint.every_n_train_steps=1"]  # fmt: skip
        proc = run_cli(args, model_cache, cwd=tmp_path)
        out, _ = proc.communicate(timeout=900)
        errors = [line for line in out.splitlines() if line.startswith("error:")]
        assert proc.returncode == 2 and len(errors) == 1, out[-3000:]
        assert re.search(r"weight '[\w.]+' of the policy after step 1 holds \d+ non-finite values", errors[0]), errors
        assert not list(diverged.rglob("*.ckpt"))
        client = ServerClient(url, token=token, timeout=60)
        assert client.weight_version() == "push-1"  # the diverged run's starting weights: nothing after them arrived
    finally:
        server.send_signal(signal.SIGTERM)
        printed.append(server.communicate(timeout=120)[0])
    assert token not in "".join(printed)  # serve's output, which logs keep, never holds the token
    assert not _server_pids(tmp_path / "node" / "servers")


@SHARES_THE_REFERENCE
def test_a_fit_pushing_over_the_network_takes_the_colocated_fits_steps(colocated, tmp_path, model_cache):
    """``rollout.server.transfer=network``: the launched server on loopback TCP gets every version over its own gloo
    group, not through files, and samples what the colocated engine samples."""
    run = tmp_path / "network"
    network = ["rollout=server", "rollout.server.host=127.0.0.1", "rollout.server.transfer=network"]
    proc = run_cli(["fit", f"output_dir={run}", *ONE_PROCESS, *DUMP, *network], model_cache, cwd=tmp_path)
    out, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, out[-4000:]
    assert "weights go to 1 rollout server(s) over the network (gloo, rendezvous at 127.0.0.1:" in out
    assert "rollout servers: http://127.0.0.1:" in out and f"(logs {run / 'servers'})" in out  # said at launch
    _assert_same_steps(colocated, run)
    assert _samples(run) == _samples(colocated) and _samples(run)
    assert all(r["train/rollout/logprob_abs_diff/mean"] < CANARY_BOUND for r in train_rows(read_metrics(run)).values())


def _wait_for_a_server(log_dir: Path, serve: subprocess.Popen, timeout: float = 300) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and serve.poll() is None:
        pids = _server_pids(log_dir) if log_dir.is_dir() else []
        if pids:
            return pids
        time.sleep(0.1)
    raise AssertionError(f"serve started no server within {timeout:g} s (exit code {serve.poll()})")


@FAULTS
def test_serve_stopped_while_its_server_starts_leaves_no_server_behind(tmp_path, model_cache):
    """SIGTERM at any moment stops serve's servers: here while its server is still starting (its process is there,
    it does not answer yet). The control: serve ended at that moment without its cleanup (SIGKILL, which is what
    SIGTERM did before serve installs its handlers, after the launch) leaves its server running, orphaned. Both
    serves start together."""
    env = {**os.environ, "STARE_LIGHTNING_CACHE": model_cache}
    serves, left = {}, {}
    try:
        for signum in (signal.SIGKILL, signal.SIGTERM):
            node = tmp_path / signum.name
            # No cold start: the moment that matters is the server's start, not the model's preparation.
            overrides = ["rollout=server", f"output_dir={node}", "model.cold_start.steps=0"]
            with open(tmp_path / f"{signum.name}.out", "wb") as out:  # a pipe nobody read would fill and stop serve
                serves[signum] = subprocess.Popen(
                    [sys.executable, "-m", "stare_lightning", "serve", *overrides],
                    cwd=tmp_path,
                    env=env,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                )
        for signum, serve in serves.items():
            started = _wait_for_a_server(tmp_path / signum.name / "servers", serve)
            serve.send_signal(signum)
            serve.wait(timeout=120)
            left[signum] = [pid for pid in started if Path(f"/proc/{pid}").exists()]
    finally:
        for signum, serve in serves.items():
            serve.kill()
            for pid in _server_pids(tmp_path / signum.name / "servers"):
                os.killpg(pid, signal.SIGKILL)  # the control's orphan (its own process group)
    assert left[signal.SIGKILL], "the control: a serve ended without its cleanup leaves its server"
    assert serves[signal.SIGTERM].returncode == 0 and not left[signal.SIGTERM]
