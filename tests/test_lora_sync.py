"""Adapter-only weight sync (``rollout.lora_sync=adapter``): the engine serves a LoRA policy's adapters over its base
and samples with the trainer's log-probs, colocated and on a server, keeping ``max_staleness + 1`` versions; a
sync moves the adapters' bytes only; the config refuses what cannot work."""

from __future__ import annotations

import json
import math
import os
import stat
import tempfile
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from stare_lightning.models.config import LoraConfig
from stare_lightning.models.lora import apply_lora
from stare_lightning.rollout.adapters import AdapterSync, adapter_weights, write_adapter
from stare_lightning.rollout.backends import ROLLOUT_BACKENDS
from stare_lightning.rollout.base import SamplingParams
from stare_lightning.rollout.transfer_dir import TransferDirectory, default_base
from stare_lightning.rollout.weights import iter_full_weights
from tests.needs import require
from tests.test_config import compose_run as compose_config

require("peft")

# One xdist worker runs this module: its server tests share one launched LoRA server (a module fixture each worker
# would otherwise start again).
pytestmark = pytest.mark.xdist_group("lora_server")

RANK = 4
VLLM_LORA_RANK = ROLLOUT_BACKENDS["vllm"].adapter_rank(RANK)  # the buffers vLLM serves this rank in
PROMPTS = [[1, 9, 10, 11, 12], [1, 30, 31, 32]]
TOKEN = "test-token-" + "0123456789" * 3
# fp32 on both sides; vLLM applies B (A x) where the trainer folds nothing: rounding only.
SAME_LOGPROBS = 1e-4


def _policy(tiny_dir, *, seed: int) -> torch.nn.Module:
    """The tiny model with rank-4 adapters set at random (as after training: B no longer 0), in eval mode."""
    from transformers import AutoModelForCausalLM

    model = apply_lora(AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32), LoraConfig(rank=RANK))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_" in name:
                param.copy_(0.3 * torch.randn(param.shape, generator=generator))
    return model.eval()


def _trainer_logprobs(model: torch.nn.Module, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].double()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]


def _largest_gap(rollouts, model: torch.nn.Module) -> float:
    """The largest |engine - trainer| log-prob over every sampled token."""
    gaps = []
    for prompt, tokens, logprobs in zip(rollouts.prompt_ids, rollouts.response_ids, rollouts.response_logprobs):
        served = torch.tensor(logprobs, dtype=torch.float64)
        gaps.append((served - _trainer_logprobs(model, prompt, tokens)).abs().max())
    return float(max(gaps))


PARAMS = SamplingParams(n=2, max_new_tokens=8, temperature=1.0)


# ------------------------------------------------------------------------------------------- the files
def test_an_adapter_is_written_as_peft_saves_it_in_a_private_directory(tiny_dir):
    policy = _policy(tiny_dir, seed=1)
    sync = AdapterSync.of(LoraConfig(rank=RANK), VLLM_LORA_RANK, max_staleness=0)
    directory = TransferDirectory()
    try:
        files = write_adapter(directory, "v1", adapter_weights(policy), sync)
        assert stat.S_IMODE(files.path.stat().st_mode) == 0o700
        assert {stat.S_IMODE(p.stat().st_mode) for p in files.path.iterdir()} == {0o600}
        config = json.loads((files.path / "adapter_config.json").read_text())
        assert (config["r"], config["lora_alpha"] / config["r"]) == (RANK, LoraConfig(rank=RANK).scaling)
        # The names peft's own save_pretrained writes, and the same tensors.
        policy.save_pretrained(tmp := Path(tempfile.mkdtemp()))
        expected = load_file(tmp / "adapter_model.safetensors")
        written = load_file(files.path / "adapter_model.safetensors")
        assert sorted(written) == sorted(expected) and all(torch.equal(written[k], expected[k]) for k in expected)
        assert files.bytes == sum(t.numel() * t.element_size() for t in expected.values())
        directory.delete("v1")
        assert directory.names() == []
    finally:
        directory.remove()


def test_adapter_weights_refuse_a_policy_without_adapters(tiny_dir):
    from transformers import AutoModelForCausalLM

    with pytest.raises(ValueError, match="needs a LoRA policy"):
        list(adapter_weights(AutoModelForCausalLM.from_pretrained(tiny_dir)))


def test_adapter_weights_refuse_an_adapter_the_engine_would_not_serve(tiny_dir):
    """peft adapts an embedding with lora_embedding_A/B, which a vLLM LoRA of linear layers leaves out: shipping the
    rest would serve another policy than the trainer's."""
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    policy = apply_lora(base, LoraConfig(rank=RANK, target_modules=["embed_tokens", "q_proj"]))
    assert any(".lora_embedding_A." in name for name, _ in policy.named_parameters())
    with pytest.raises(ValueError, match="cannot serve .*lora_embedding_A"):
        list(adapter_weights(policy))


def test_vllms_rank_buckets():  # the kept window: tests/test_adapter_versions.py
    from stare_lightning.rollout.backends import ROLLOUT_BACKENDS
    from stare_lightning.rollout.config import RolloutConfig
    from stare_lightning.rollout.lora_sync import adapter_sync

    vllm, server = ROLLOUT_BACKENDS["vllm"], ROLLOUT_BACKENDS["server"]
    adapter = RolloutConfig(backend="vllm", lora_sync="adapter", max_staleness=0)
    assert [adapter_sync(adapter, LoraConfig(rank=r), vllm).max_lora_rank for r in (1, 4, 8, 9, 300)] == [
        1,
        8,
        8,
        16,
        320,
    ]
    assert server.adapter_rank(300) == 320 and ROLLOUT_BACKENDS["hf"].adapter_rank(1) is None
    on_server = RolloutConfig(backend="server", lora_sync="adapter", max_staleness=2)
    assert adapter_sync(on_server, LoraConfig(rank=16), server).vllm_kwargs()["max_loras"] == 3
    with pytest.raises(ValueError, match="vLLM serves LoRA adapters up to rank 512"):
        adapter_sync(adapter, LoraConfig(rank=600), vllm)


# --------------------------------------------------------------------------------------- the config
@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["rollout.lora_sync=merged"], "does nothing without LoRA"),
        (["model.lora.rank=4", "rollout=hf", "rollout.lora_sync=adapter"], "does nothing with rollout.backend=hf"),
        (["model.lora.rank=4", "rollout.lora_sync=both"], "rollout.lora_sync"),
        (["model.lora.rank=600", "rollout=vllm", "rollout.lora_sync=adapter"], "vLLM serves LoRA adapters up to rank"),
    ],
)
def test_lora_sync_settings_that_would_do_nothing_or_break_are_refused(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        compose_config(tmp_path, overrides)


def test_adapter_mode_is_the_default_on_gpus_where_the_backend_serves_adapters():
    from stare_lightning.rollout.backends import ROLLOUT_BACKENDS
    from stare_lightning.rollout.config import RolloutConfig
    from stare_lightning.rollout.lora_sync import adapter_sync

    lora, vllm, hf = LoraConfig(rank=8), ROLLOUT_BACKENDS["vllm"], ROLLOUT_BACKENDS["hf"]
    assert adapter_sync(RolloutConfig(backend="vllm"), lora, vllm, on_gpu=True) is not None
    # On a CPU vLLM's LoRA decode is slow (benchmarks/bench_lora.py): auto syncs merged weights, adapter insists.
    assert adapter_sync(RolloutConfig(backend="vllm"), lora, vllm, on_gpu=False) is None
    assert adapter_sync(RolloutConfig(backend="vllm", lora_sync="adapter"), lora, vllm, on_gpu=False) is not None
    assert adapter_sync(RolloutConfig(backend="vllm", lora_sync="merged"), lora, vllm, on_gpu=True) is None
    assert adapter_sync(RolloutConfig(backend="hf"), lora, hf, on_gpu=True) is None
    assert adapter_sync(RolloutConfig(backend="vllm"), None, vllm, on_gpu=True) is None
    # A rank above vLLM's largest LoRA rank: auto falls back to merged weights (adapter is refused at config time).
    assert adapter_sync(RolloutConfig(backend="vllm"), LoraConfig(rank=600), vllm, on_gpu=True) is None
    # rollout.backend=auto resolved to HF (no vLLM): an explicit adapter mode cannot be honoured, and says so.
    with pytest.raises(ValueError, match="resolved to hf"):
        adapter_sync(RolloutConfig(backend="auto", lora_sync="adapter"), lora, hf)


# ------------------------------------------------------------------------------------ the colocated engine
@pytest.mark.vllm
def test_the_colocated_engine_serves_each_synced_adapter_with_the_trainers_logprobs(tiny_dir):
    require("vllm")
    from stare_lightning.rollout.vllm import VLLMRolloutEngine

    sync = AdapterSync.of(LoraConfig(rank=RANK), VLLM_LORA_RANK, max_staleness=0)
    engine = VLLMRolloutEngine(tiny_dir, seed=0, adapters=sync, kv_cache_memory_bytes=64 << 20, max_model_len=256)
    try:
        for seed in (1, 2):  # two versions: the second replaces the first
            policy = _policy(tiny_dir, seed=seed)
            engine.sync_weights(policy)
            rollouts = engine.generate(PROMPTS, PARAMS, seeds=[3, 4])
            assert _largest_gap(rollouts, policy) < SAME_LOGPROBS
            with policy.disable_adapter():  # the check could fail: the base alone samples other log-probs
                assert _largest_gap(rollouts, policy) > 100 * SAME_LOGPROBS
        assert engine._adapters.names == ["policy-v2"] and engine.llm.llm_engine.list_loras() == {2}
        assert engine._adapters.directory().names() == ["policy-v2"]  # the first version's files are gone
        merged = sum(t.numel() * t.element_size() for _, t in iter_full_weights(policy))
        adapters = sum(t.numel() * t.element_size() for _, t in adapter_weights(policy))
        assert engine.last_sync_bytes == adapters < merged / 10
        path = engine._adapters.directory().path
    finally:
        engine.close()
    assert not path.exists()


# --------------------------------------------------------------------------------------------- a server
@pytest.fixture(scope="module")
def lora_server(tiny_dir, tmp_path_factory):
    require("vllm")
    from stare_lightning.rollout.server.trainer_side.launch import LaunchedServers, ServerSpec

    sockets = Path(tempfile.mkdtemp(prefix="stare-lightning-test-servers-", dir=default_base()))
    spec = ServerSpec(0, uds=str(sockets / "0.sock"))
    sync = AdapterSync.of(LoraConfig(rank=RANK), VLLM_LORA_RANK, max_staleness=1)
    with LaunchedServers(
        tiny_dir,
        [spec],
        log_dir=tmp_path_factory.mktemp("lora_server_logs"),
        token=TOKEN,
        max_model_len=256,
        kv_cache_memory_bytes=64 << 20,
        socket_dir=sockets,
        adapters=sync,
    ) as launched:
        yield launched.urls[0], sync


@pytest.mark.vllm
def test_a_server_keeps_k_plus_one_adapter_versions_each_with_its_policys_logprobs(lora_server, tiny_dir):
    from stare_lightning.rollout.server.trainer_side.client import RolloutServerError, ServerClient
    from stare_lightning.rollout.server.trainer_side.engine import ServerRolloutEngine

    url, sync = lora_server
    client = ServerClient(url, token=TOKEN, timeout=120)
    engine = ServerRolloutEngine([client], chunk_bytes=1 << 20, adapters=sync, run_tag="test")
    try:
        policies = {}
        for seed in (1, 2, 3):
            policies[seed] = _policy(tiny_dir, seed=seed)
            version = engine.push(engine.gather_weights(policies[seed]), version=f"v{seed}")
            assert engine._adapter_name(version) == f"test-v{seed}"
        assert _largest_gap(engine.generate(PROMPTS, PARAMS, seeds=[3, 4]), policies[3]) < SAME_LOGPROBS
        # max_staleness=1: the version before the newest is still served, as a request sent before the push
        # would have named it, with that version's log-probs.
        engine.version = "v2"
        assert _largest_gap(engine.generate(PROMPTS, PARAMS, seeds=[3, 4]), policies[2]) < SAME_LOGPROBS
        engine.version = "v1"  # two pushes ago: unloaded, and its files deleted
        with pytest.raises(RolloutServerError, match="test-v1"):
            engine.generate(PROMPTS, PARAMS, seeds=[3, 4])
        assert engine._adapters.directory().names() == ["test-v2", "test-v3"]
        assert engine.last_sync_bytes == sum(t.numel() * t.element_size() for _, t in adapter_weights(policies[3]))
        assert {"test-v2", "test-v3"} <= _served(client)
    finally:
        engine.close()
    # The server outlives the run (it did not launch it): the run's adapters are gone from it with their files.
    assert not {name for name in _served(client) if name.startswith("test-")}


def _served(client) -> set[str]:
    """The model names a vLLM server serves: its base model and the adapters loaded on it."""
    return {model["id"] for model in client._request("GET", "/v1/models")["data"]}


def test_adapter_names_keep_the_producers_versions():
    """Every rank names a version's adapter the same way; merged weights name none."""
    from stare_lightning.rollout.server.trainer_side.client import ServerClient
    from stare_lightning.rollout.server.trainer_side.engine import ServerRolloutEngine

    client = ServerClient("http://127.0.0.1:9", token=TOKEN, timeout=1)
    sync = AdapterSync.of(LoraConfig(rank=RANK), VLLM_LORA_RANK)
    engine = ServerRolloutEngine([client], chunk_bytes=1 << 20, adapters=sync, run_tag="run1a2b")
    merged = ServerRolloutEngine([client], chunk_bytes=1 << 20)
    try:
        assert engine._adapter_name(None) is None and engine._adapter_name("v7") == "run1a2b-v7"
        assert merged._adapter_name("v7") is None
    finally:
        engine.close()
        merged.close()


# ------------------------------------------------------------------------- the server against another local user
def _write_adapter_files(folder: Path, weights, sync: AdapterSync) -> Path:
    """A peft adapter directory written by path, as anyone could make one (a look-alike, a crafted one)."""
    from safetensors.torch import save_file

    folder.mkdir(mode=0o700)
    (folder / "adapter_config.json").write_text(json.dumps(sync.peft_config()))
    save_file({name: tensor.contiguous() for name, tensor in weights}, str(folder / "adapter_model.safetensors"))
    return folder


def _served_gap(client, name: str, model: torch.nn.Module) -> float:
    """The largest |served - trainer| log-prob of a short sample drawn with adapter ``name``."""
    from stare_lightning.rollout.server.trainer_side.engine import sampling_request

    completion = client.generate(PROMPTS[0], sampling_request(PARAMS, 7, 8), adapter=name)[0]
    served = torch.tensor(completion.logprobs, dtype=torch.float64)
    return float((served - _trainer_logprobs(model, PROMPTS[0], completion.token_ids)).abs().max())


@pytest.mark.vllm
def test_the_adapter_route_loads_only_finite_adapters_its_user_owns(lora_server, tiny_dir, other_user, tmp_path):
    """Refused (400, one line on the trainer's side): an adapter holding NaN, one in a directory of another user, one
    reached through a link. The control: the same files in a directory of the server's user are loaded and served
    with their policy's log-probs."""
    from stare_lightning.rollout.server.trainer_side.client import RolloutServerError, ServerClient

    url, sync = lora_server
    client = ServerClient(url, token=TOKEN, timeout=120)
    policy = _policy(tiny_dir, seed=11)
    weights = list(adapter_weights(policy))
    poisoned = [(name, tensor.clone()) for name, tensor in weights]
    poisoned[0][1][0, 0] = float("nan")
    crafted = {
        "non-finite": (_write_adapter_files(tmp_path / "nan", poisoned, sync), "1 non-finite values"),
        "foreign": (_write_adapter_files(tmp_path / "foreign", weights, sync), f"is owned by uid {other_user.uid}"),
    }
    for path in [crafted["foreign"][0], *crafted["foreign"][0].iterdir()]:
        os.chown(path, other_user.uid, other_user.gid)
    (tmp_path / "link").symlink_to(tmp_path / "good")
    crafted["link"] = (tmp_path / "link", "cannot be opened as a directory")
    for name, (path, why) in crafted.items():
        with pytest.raises(RolloutServerError, match="HTTP 400") as refused:
            client.load_adapter(f"crafted-{name}", str(path))
        assert why in str(refused.value) and "\n" not in str(refused.value)
    assert not {name for name in _served(client) if name.startswith("crafted-")}
    # The control: the foreign adapter's very files, in a directory of the server's user, are served as trained.
    good = _write_adapter_files(tmp_path / "good", weights, sync)
    client.load_adapter("checked-good", str(good))
    try:
        assert _served_gap(client, "checked-good", policy) < SAME_LOGPROBS
        base = client.generate(PROMPTS[1], {**_greedy(), "seed": 3})[0]
        assert all(math.isfinite(value) for value in base.logprobs)  # nothing non-finite left in the cache
    finally:
        client.unload_adapter("checked-good")


@pytest.mark.vllm
def test_adapters_sent_inside_their_requests_are_served_as_trained_and_unsigned_ones_refused(lora_server, tiny_dir):
    """For a server on another host (``inline_adapters``, chosen with the network transfer): every version's files go
    in its load request, signed with the run's secret, and are served with their policy's log-probs; the same files
    signed with another secret are refused (400) and never served."""
    from stare_lightning.rollout.server.shared.adapter_wire import inline_load_request
    from stare_lightning.rollout.server.trainer_side.client import RolloutServerError, ServerClient
    from stare_lightning.rollout.server.trainer_side.engine import ServerRolloutEngine

    url, sync = lora_server
    client = ServerClient(url, token=TOKEN, timeout=120)
    engine = ServerRolloutEngine([client], chunk_bytes=1 << 20, adapters=sync, run_tag="inline", inline_adapters=True)
    try:
        policies = {seed: _policy(tiny_dir, seed=seed) for seed in (21, 22)}
        for seed, policy in policies.items():
            engine.push(engine.gather_weights(policy), version=f"v{seed}")
        assert _largest_gap(engine.generate(PROMPTS, PARAMS, seeds=[3, 4]), policies[22]) < SAME_LOGPROBS
        engine.version = "v21"  # the kept older version, sent the same way
        assert _largest_gap(engine.generate(PROMPTS, PARAMS, seeds=[3, 4]), policies[21]) < SAME_LOGPROBS
        files = engine._adapters.current.contents
        forged = inline_load_request("inline-forged", files, "another-secret-" + "x" * 24)
        with pytest.raises(RolloutServerError, match="HTTP 400.*digest does not match its files"):
            client._request("POST", "/v1/load_lora_adapter", forged, answer_json=False)
        assert "inline-forged" not in _served(client) and {"inline-v21", "inline-v22"} <= _served(client)
    finally:
        engine.close()


def _greedy() -> dict:
    from stare_lightning.rollout.server.trainer_side.engine import sampling_request

    return sampling_request(PARAMS, 3, 8)


@pytest.mark.vllm
def test_a_server_swapped_for_a_look_alike_while_it_loads_serves_the_trainers_adapter_or_stops(
    lora_server, tiny_dir, other_user, shared_scratch
):
    """The issue's attack: the transfer directory (0700) sits in a project directory its group may write, and a
    member exchanges it with a look-alike tree of theirs, again and again, while the trainer pushes adapters. Every
    push either serves the trainer's adapter (its log-probs) or stops in one line; the control: the look-alike's
    adapter, loaded as the trainer's would be, serves other log-probs, so a served swap would show."""
    from stare_lightning.rollout.server.trainer_side.client import RolloutServerError, ServerClient
    from stare_lightning.rollout.server.trainer_side.engine import ServerRolloutEngine
    from stare_lightning.rollout.transfer_dir import UnsafeTransferDirectory

    url, sync = lora_server
    client = ServerClient(url, token=TOKEN, timeout=120)
    project = shared_scratch / "project"
    project.mkdir(mode=0o777)
    project.chmod(0o777)  # group-writable in the issue; any writer may exchange entries of a non-sticky directory
    base = project / "transfer"
    base.mkdir(mode=0o700)
    trainer_policy, attacker_policy = _policy(tiny_dir, seed=21), _policy(tiny_dir, seed=22)
    engine = ServerRolloutEngine([client], chunk_bytes=1 << 20, adapters=sync, run_tag="swap", transfer_dir=str(base))
    swapper, outcomes, look_alike, real = None, [], project / "look-alike", base.stat().st_ino
    try:
        inner = engine._adapters.directory().name  # made now, so that the look-alike copies its name
        for version in range(1, 5):  # the names the trainer will load, with the attacker's adapter in each
            _write_adapter_files_tree(look_alike / inner, f"swap-v{version}", adapter_weights(attacker_policy), sync)
        _chown_tree(look_alike, other_user)
        stop, swapping = shared_scratch / "stop", project / "swapping"  # the other user may write in project
        swapper = other_user.start(
            _EXCHANGE.format(first=str(base), second=str(look_alike), stop=str(stop), swapping=str(swapping))
        )
        # The pushes start once the exchanges have: a swapper still starting would let every push through unswapped.
        deadline = time.monotonic() + 60
        while not swapping.exists() and swapper.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert swapping.exists(), "the other user's swapper never started exchanging"
        for version in range(1, 5):
            try:
                engine.push(engine.gather_weights(trainer_policy), version=f"v{version}")
            except (RolloutServerError, UnsafeTransferDirectory) as error:
                assert "\n" not in str(error)
                outcomes.append(f"stopped ({type(error).__name__})")
                continue
            outcomes.append("served")
            assert _served_gap(client, f"swap-v{version}", trainer_policy) < SAME_LOGPROBS
        exchanging = swapper.poll() is None  # it ran through every push (a refused push is over in milliseconds)
        stop.touch()
        swaps = other_user.finish(swapper)["swaps"]
        swapper = None
    finally:
        if swapper is not None:
            swapper.kill()
            swapper.communicate()
        _put_back(base, look_alike, real)
        engine.close()
        for name in [name for name in _served(client) if name.startswith("swap-")]:
            client.unload_adapter(name)
    assert len(outcomes) == 4 and exchanging and swaps >= 1, (outcomes, swaps)
    # The control: the look-alike's adapter, had it been loaded, would not pass for the trainer's.
    control = _write_adapter_files(shared_scratch / "control", adapter_weights(attacker_policy), sync)
    client.load_adapter("control-look-alike", str(control))
    try:
        assert _served_gap(client, "control-look-alike", trainer_policy) > 100 * SAME_LOGPROBS
    finally:
        client.unload_adapter("control-look-alike")


# Run as the other user: swap two entries of a directory it may write, without pause, until ``stop`` exists (or a
# minute has passed), then say how often.
_EXCHANGE = """
first, second, spare, stop = {first!r}, {second!r}, {first!r} + ".away", {stop!r}
until = time.monotonic() + 60
swaps = 0
while time.monotonic() < until and not os.path.exists(stop):
    os.rename(first, spare)
    os.rename(second, first)
    os.rename(spare, second)
    swaps += 1
    if swaps == 1:
        open({swapping!r}, "w").close()
    time.sleep(0.002)
print(json.dumps({{"swaps": swaps}}))
"""


def _write_adapter_files_tree(folder: Path, name: str, weights, sync: AdapterSync) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    _write_adapter_files(folder / name, weights, sync)


def _chown_tree(top: Path, user) -> None:
    for path in [top, *top.rglob("*")]:
        os.chown(path, user.uid, user.gid)


def _put_back(base: Path, look_alike: Path, real: int) -> None:
    """After the swapper is stopped: the trainer's directory back at its name (it may be at any of three)."""
    places = [base, look_alike, base.with_name(base.name + ".away")]
    found = {place: place.stat().st_ino for place in places if place.exists()}
    for place, inode in found.items():
        if inode == real and place != base:
            if base.exists():
                base.rename(base.with_name("displaced"))
            place.rename(base)


@pytest.mark.vllm
def test_the_servers_engine_ports_are_out_of_another_users_reach(lora_server, other_user):
    """The worker's gloo listeners (a dozen TCP ports) exist only in the server's own network namespace: another
    user's connect-and-close flood of those ports on the host's loopback reaches none of them and the server keeps
    serving. The control, a gloo group on the host's network dying of the same flood: tests/test_private_net.py."""
    from stare_lightning.rollout.server.trainer_side import http
    from stare_lightning.rollout.server.trainer_side.client import ServerClient
    from tests.engine_ports import (
        FLOOD,
        listening_ports,
        network_namespace,
        ports_listened_on_here,
        process_group,
        server_pid,
    )

    url, _ = lora_server
    members = process_group(server_pid(url.removeprefix(http.UNIX_SCHEME)))
    # A port number some other process on the host happens to listen on too (another test's engine, say) would
    # answer the flood for reasons of its own: the flood goes to the server's ports that are free on the host.
    taken = ports_listened_on_here()
    ports = sorted({port for pid in members for port in listening_ports(pid) if port[1] not in taken})
    assert len(ports) >= 2, "the engine's worker listens on TCP in its namespace"
    assert network_namespace("self") not in {network_namespace(pid) for pid in members}
    flood = other_user.run(FLOOD.format(ports=ports, rounds=150), timeout=120)
    assert flood["connected"] == 0 and flood["refused"] == 150 * len(ports)
    completion = ServerClient(url, token=TOKEN, timeout=120).generate(PROMPTS[0], _greedy())[0]
    assert completion.token_ids and all(math.isfinite(value) for value in completion.logprobs)
