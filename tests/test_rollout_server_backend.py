"""The server side of rollout=server against a real stock vLLM server on the tiny model (on a Unix socket in a private
directory, as a launched server listens): the token guard, a weight push through the file backend (log-probs after
it equal an HF forward of the pushed weights), crafted pushes the backend refuses while the server keeps serving its
weights (non-finite ones included), the chunk writer, a launch that fails; with a second local user: a transfer
directory of theirs refused, one swapped mid-run ending the push in one line, and a flood of half-open connections
that never reaches the server while the trainer's requests go on."""

from __future__ import annotations

import json
import os
import re
import socket
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from stare_lightning.rollout.server.shared.engine_start import FORK_ENGINE_CORE_ENV
from stare_lightning.rollout.server.shared.transfer import (
    DTYPES,
    TransferRefused,
    checkpoint_shapes,
    parse_chunk,
    write_chunks,
)
from stare_lightning.rollout.server.trainer_side import http
from stare_lightning.rollout.transfer_dir import default_base

TOKEN = "test-token-" + "0123456789" * 3
HTTP_TIMEOUT_S = 120  # one request on a busy two-core machine; a push of the tiny model takes well under a second
PROMPT = [1, 9, 10, 11, 12]
TEMPERATURE = 0.7


# ---- the chunk writer and the checks that need no server ----


def _weights(seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    shapes = {"a.weight": (3, 5), "b.bias": (7,), "c.scale": (), "d.empty": (0, 4), "e.big": (40, 10)}
    dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.float32, torch.float32]
    return [
        (name, torch.randn(shape, generator=generator).to(dtype))
        for (name, shape), dtype in zip(shapes.items(), dtypes)
    ]


def _read_back(directory: Path, infos: list[dict]) -> dict[str, torch.Tensor]:
    out = {}
    for info in infos:
        spec = parse_chunk(info)
        raw = (directory / spec.file).read_bytes()
        assert len(raw) == spec.total_bytes
        offset = 0
        for name, dtype, shape, size in zip(spec.names, spec.dtype_names, spec.shapes, spec.sizes):
            tensor = torch.empty(shape, dtype=DTYPES[dtype])
            tensor.reshape(-1).view(torch.uint8).copy_(
                torch.tensor(list(raw[offset : offset + size]), dtype=torch.uint8)
            )
            out[name] = tensor
            offset += size
    return out


def test_write_chunks_round_trips_bit_exactly_and_splits_at_chunk_bytes(tmp_path):
    weights = _weights()
    infos = list(write_chunks(iter(weights), tmp_path, chunk_bytes=100))
    back = _read_back(tmp_path, infos)
    assert list(back) == [name for name, _ in weights]
    for name, tensor in weights:
        assert back[name].dtype == tensor.dtype and back[name].shape == tensor.shape
        assert torch.equal(back[name].reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8))
    # 60 + 14 bytes fit 100; c (2 bytes) and d (0) join b's chunk... a chunk closes once it reaches 100 bytes, and
    # e (1600 bytes, larger than a chunk) travels alone.
    assert [info["names"] for info in infos] == [["a.weight", "b.bias", "c.scale", "d.empty"], ["e.big"]]
    assert all(sum(info["tensor_sizes"]) <= 100 for info in infos if len(info["names"]) > 1)
    assert [info["file"] for info in infos] == ["chunk-0.bin", "chunk-1.bin"]
    # One chunk per tensor when every tensor reaches the size; all in one when the size is large.
    for chunk_bytes, count in ((1, len(weights)), (1 << 20, 1)):
        (tmp_path / str(chunk_bytes)).mkdir()
        assert len(list(write_chunks(weights, tmp_path / str(chunk_bytes), chunk_bytes=chunk_bytes))) == count


def test_write_chunks_yields_each_chunk_once_written(tmp_path):
    written = write_chunks(_weights(), tmp_path, chunk_bytes=1)
    first = next(written)
    assert (tmp_path / first["file"]).stat().st_size == sum(first["tensor_sizes"])
    assert not (tmp_path / "chunk-1.bin").exists()  # the next tensor is not packed until asked for


def test_write_chunks_refuses_other_dtypes(tmp_path):
    with pytest.raises(ValueError, match=r"'x' has dtype float64"):
        list(write_chunks([("x", torch.zeros(2, dtype=torch.float64))], tmp_path))


GOOD_INFO = {
    "file": "chunk-0.bin",
    "names": ["w"],
    "dtype_names": ["float32"],
    "shapes": [[2, 3]],
    "tensor_sizes": [24],
}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"file": "../chunk-0.bin"}, "not a plain file name"),
        ({"file": "sub/chunk-0.bin"}, "not a plain file name"),
        ({"file": ".."}, "not a plain file name"),
        ({"file": 7}, "not a plain file name"),
        ({"dtype_names": ["float64"]}, "dtype 'float64' is not one of"),
        ({"dtype_names": ["int8"]}, "dtype 'int8' is not one of"),
        ({"shapes": [[2, -3]]}, "not a list of at most"),
        ({"shapes": [[2, True]]}, "not a list of at most"),
        ({"shapes": [[2, 4]]}, "24 bytes do not match shape"),
        ({"tensor_sizes": [23]}, "23 bytes do not match shape"),
        ({"tensor_sizes": [24, 4]}, "differ in length"),
        ({"names": ["w x"]}, "not a checkpoint name"),
        ({"names": [""]}, "not a checkpoint name"),
        ({"names": []}, "differ in length"),
        ({"extra": 1}, "unknown: \\['extra'\\]"),
    ],
)
def test_parse_chunk_refuses_crafted_descriptions(change, message):
    assert parse_chunk(GOOD_INFO).total_bytes == 24
    with pytest.raises(TransferRefused, match=message):
        parse_chunk({**GOOD_INFO, **change})


def test_parse_chunk_refuses_a_name_twice():
    info = {**GOOD_INFO, "names": ["w", "w"], "dtype_names": ["float32"] * 2, "shapes": [[2, 3]] * 2}
    with pytest.raises(TransferRefused, match="twice"):
        parse_chunk({**info, "tensor_sizes": [24, 24]})


def test_checkpoint_shapes_reads_the_safetensors_headers(tiny_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    shapes = checkpoint_shapes(tiny_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    assert shapes == {name: tuple(param.shape) for name, param in model.named_parameters()}
    with pytest.raises(TransferRefused, match=r"not a directory with \*\.safetensors"):
        checkpoint_shapes(tmp_path)


# ---- the token guard and the plugin without a server ----


def test_token_guard_refuses_to_start_without_its_token(monkeypatch):
    from stare_lightning.rollout.server.in_vllm.auth import RequireToken
    from stare_lightning.rollout.server.shared.token import TOKEN_ENV

    monkeypatch.delenv(TOKEN_ENV, raising=False)
    with pytest.raises(RuntimeError, match=TOKEN_ENV):
        RequireToken(app=None)


def test_token_guard_refuses_a_short_token_as_the_launcher_does(monkeypatch):
    """A hand-started server builds the guard itself: the 32-character minimum holds there too (the control: 32)."""
    from stare_lightning.rollout.server.in_vllm.auth import RequireToken
    from stare_lightning.rollout.server.shared.token import MIN_TOKEN_CHARS, TOKEN_ENV

    monkeypatch.setenv(TOKEN_ENV, "x" * (MIN_TOKEN_CHARS - 1))
    with pytest.raises(RuntimeError, match=f"has {MIN_TOKEN_CHARS - 1} characters; a server credential needs at least"):
        RequireToken(app=None)
    monkeypatch.setenv(TOKEN_ENV, "x" * MIN_TOKEN_CHARS)
    assert RequireToken(app=None)._expected == b"Bearer " + b"x" * MIN_TOKEN_CHARS


@pytest.mark.vllm
def test_plugin_is_installed_and_registers_once():
    from importlib.metadata import entry_points

    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    from stare_lightning.rollout.server.in_vllm.plugin import register
    from stare_lightning.rollout.server.shared.transfer import BACKEND

    (entry,) = [e for e in entry_points(group="vllm.general_plugins") if e.name == "stare_lightning"]
    assert entry.load() is register
    register()
    register()  # vLLM loads plugins more than once per process family
    assert WeightTransferEngineFactory._registry[BACKEND]().__name__ == "CheckedWeightTransferEngine"


# ---- launching ----


def test_a_server_that_cannot_start_names_its_url_and_log(tmp_path):
    from stare_lightning.rollout.server.trainer_side.launch import (
        LaunchedServers,
        ServerSpec,
        ServerStartError,
        free_ports,
    )

    (port,) = free_ports(1)
    servers = LaunchedServers(
        tmp_path / "no-such-model", [ServerSpec(port)], log_dir=tmp_path, token=TOKEN, startup_timeout=300
    )
    with pytest.raises(ServerStartError) as err:
        servers.start()
    message = str(err.value)
    assert f"http://127.0.0.1:{port}" in message and "exited with code" in message
    assert str(tmp_path / f"server-{port}.log") in message and "no-such-model" in message
    assert servers.dead() == []  # stopped
    # A server on TCP keeps its engine's ports on the host's network (private_net.py), and its log says so.
    note = (tmp_path / f"server-{port}.log").read_text().splitlines()[1]
    assert note == "# its engine's TCP ports are on the host's network (it listens on TCP)"


def test_a_port_in_use_is_named_before_anything_starts(tmp_path):
    from stare_lightning.rollout.server.trainer_side.launch import LaunchedServers, ServerSpec, ServerStartError

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        servers = LaunchedServers("unused", [ServerSpec(port)], log_dir=tmp_path, token=TOKEN)
        with pytest.raises(ServerStartError, match=rf"http://127\.0\.0\.1:{port} cannot listen on port {port}"):
            servers.start()
    assert not (tmp_path / f"server-{port}.log").exists()


def test_a_cpu_server_runs_eagerly_with_nothing_to_compile_and_a_gpu_server_as_vllm_chooses(tmp_path, monkeypatch):
    """On a CPU the engine is eager, and vLLM's sampler helper, which it would still compile, runs eagerly too
    (rollout/vllm_process.py says why); a server given GPUs compiles as vLLM decides."""
    from stare_lightning.rollout.server.trainer_side.launch import LaunchedServers, ServerSpec

    monkeypatch.delenv("TORCH_COMPILE_DISABLE", raising=False)
    cpu, gpu = ServerSpec(8000), ServerSpec(8001, gpus="0")
    servers = LaunchedServers("unused", [cpu, gpu], log_dir=tmp_path, token=TOKEN)
    assert "--enforce-eager" in servers.command(cpu) and servers.environment(cpu)["TORCH_COMPILE_DISABLE"] == "1"
    assert "--enforce-eager" not in servers.command(gpu) and "TORCH_COMPILE_DISABLE" not in servers.environment(gpu)
    # The CPU server forks its engine core; the GPU server's starts as vLLM decides, whatever this process had set.
    monkeypatch.setenv(FORK_ENGINE_CORE_ENV, "1")
    assert servers.environment(cpu)[FORK_ENGINE_CORE_ENV] == "1"
    assert FORK_ENGINE_CORE_ENV not in servers.environment(gpu)


# ---- one real server ----


def _request(url: str, path: str, body=None, *, token: str | None = TOKEN, method: str | None = None):
    """(status, parsed JSON body) of one request."""
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    data = None if body is None else json.dumps(body).encode()
    status, payload = http.request(url, method or ("POST" if data else "GET"), path, data, headers, HTTP_TIMEOUT_S)
    return status, json.loads(payload or b"null")


def _ok(url: str, path: str, body=None, method: str | None = None):
    status, answer = _request(url, path, body, method=method)
    assert status == 200, (path, status, answer)
    return answer


# The tests on the module's server run on one xdist worker, so the server starts once.
SHARES_THE_SERVER = pytest.mark.xdist_group("server_backend")


@contextmanager
def _launched_server(tiny_dir, tmp_path_factory, on_tcp: bool):
    from tests.needs import require

    require("vllm")
    from stare_lightning.rollout.server.trainer_side.launch import LaunchedServers, ServerSpec, free_ports

    # As a launched server listens: a Unix socket in a directory only this user may enter (mkdtemp: 0700), in a
    # network namespace of its own; or on loopback TCP, on the host's network, which the network transfer needs.
    sockets = None if on_tcp else Path(tempfile.mkdtemp(prefix="stare-lightning-test-servers-", dir=default_base()))
    logs = tmp_path_factory.mktemp("server_logs")
    spec = ServerSpec(free_ports(1)[0], host="127.0.0.1") if on_tcp else ServerSpec(0, uds=str(sockets / "0.sock"))
    with LaunchedServers(
        tiny_dir,
        [spec],
        log_dir=logs,
        token=TOKEN,
        max_model_len=256,
        kv_cache_memory_bytes=64 << 20,
        socket_dir=sockets,
    ) as launched:
        directory = tmp_path_factory.mktemp("transfer")
        directory.chmod(0o700)
        _ok(launched.urls[0], "/init_weight_transfer_engine", {"init_info": {"directory": str(directory)}})
        yield launched.urls[0], directory


@pytest.fixture(scope="module")
def server(tiny_dir, tmp_path_factory):
    with _launched_server(tiny_dir, tmp_path_factory, on_tcp=False) as found:
        yield found


@pytest.fixture(scope="module")
def tcp_server(tiny_dir, tmp_path_factory):
    """A server on loopback TCP: one on a Unix socket runs in a network namespace of its own, where the trainer's
    rendezvous for the network transfer cannot be reached (and the config refuses that pairing)."""
    with _launched_server(tiny_dir, tmp_path_factory, on_tcp=True) as found:
        yield found


def _generate(url: str) -> tuple[list[int], torch.Tensor]:
    answer = _ok(
        url,
        "/inference/v1/generate",
        {
            "token_ids": PROMPT,
            "sampling_params": {
                "n": 1,
                "max_tokens": 8,
                "seed": 7,
                "temperature": TEMPERATURE,
                "top_p": 1.0,
                "top_k": -1,
                "logprobs": 0,
                "ignore_eos": True,
            },
        },
    )
    (choice,) = answer["choices"]
    return choice["token_ids"], torch.tensor([entry["logprob"] for entry in choice["logprobs"]["content"]])


def _hf_logprobs(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT + ids])).logits[0, len(PROMPT) - 1 : -1].double()
    return torch.log_softmax(logits / TEMPERATURE, -1).gather(-1, torch.tensor(ids)[:, None])[:, 0]


def _perturbed(tiny_dir, seed: int):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=generator))
    return model


def _push(url: str, directory: Path, weights, version: str, *, chunk_bytes: int = 100_000) -> None:
    _ok(url, "/pause?mode=wait", method="POST")
    try:
        _ok(url, "/start_weight_update", method="POST")
        for info in write_chunks(weights, directory, chunk_bytes=chunk_bytes):
            _ok(url, "/update_weights", {"update_info": info})
        _ok(url, "/finish_weight_update", {"weight_version": version})
    finally:
        _ok(url, "/resume", method="POST")
        _clear(directory)


def _clear(directory: Path) -> None:
    for entry in directory.iterdir():
        if not entry.is_dir() or entry.is_symlink():
            entry.unlink()


def _named(model) -> list[tuple[str, torch.Tensor]]:
    return [(name, param.detach()) for name, param in model.named_parameters()]


@SHARES_THE_SERVER
@pytest.mark.vllm
def test_every_route_but_health_needs_the_token(server):
    url, _ = server
    assert _request(url, "/health", token=None)[0] == 200
    for path, body in [
        ("/pause", None),
        ("/resume", None),
        ("/update_weights", {"update_info": {}}),
        ("/collective_rpc", {"method": "get_model"}),
        ("/v1/completions", {"model": "x", "prompt": [1, 2], "max_tokens": 1}),
        ("/inference/v1/generate", {"token_ids": [1, 2], "sampling_params": {"max_tokens": 1}}),
    ]:
        for token in (None, "wrong-token"):
            status, answer = _request(url, path, body, token=token, method="POST")
            assert status == 401 and "Unauthorized" in answer["error"], (path, token, status, answer)
    assert _request(url, "/weight_info", token=None)[0] == 401
    assert _request(url, "/is_paused")[1] == {"is_paused": False}  # nothing above paused it


@SHARES_THE_SERVER
@pytest.mark.vllm
def test_a_push_serves_the_pushed_weights(server, tiny_dir):
    url, directory = server
    from transformers import AutoModelForCausalLM

    original = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    ids, before = _generate(url)
    assert (before.double() - _hf_logprobs(original, ids)).abs().max() < 1e-5

    pushed = _perturbed(tiny_dir, seed=1)
    _push(url, directory, _named(pushed), "step-1")
    assert _ok(url, "/weight_info") == {"weight_version": "step-1"}
    ids, after = _generate(url)
    assert (after.double() - _hf_logprobs(pushed, ids)).abs().max() < 1e-5
    assert (after.double() - _hf_logprobs(original, ids)).abs().max() > 1e-3  # the push changed what is served


def _crafted_rounds(tiny_dir, directory: Path, outside: Path):
    """(what, the chunks of one round, what the refusal says): each refused before the model is touched."""
    good = list(write_chunks(_named(_perturbed(tiny_dir, seed=2)), directory, chunk_bytes=100_000))
    first, rest = good[0], good[1:]
    (outside / "stolen.bin").write_bytes((directory / first["file"]).read_bytes())
    os.symlink(outside / "stolen.bin", directory / "link.bin")
    os.mkfifo(directory / "fifo.bin")
    os.mkdir(directory / "dir.bin")
    with open(directory / "nan.bin", "wb") as out:  # the first chunk's tensors, every value NaN
        for dtype, shape in zip(first["dtype_names"], first["shapes"]):
            out.write(torch.full(shape, float("nan"), dtype=DTYPES[dtype]).reshape(-1).view(torch.uint8).numpy())
    multi = next(chunk for chunk in good if len(chunk["names"]) > 1)
    short = {key: value[:-1] if isinstance(value, list) else value for key, value in multi.items()}  # its last dropped
    return [
        ("a path out of the directory", [dict(first, file="../" + outside.name + "/stolen.bin")], "plain file name"),
        ("a file name with a slash", [dict(first, file="sub/" + first["file"])], "plain file name"),
        ("a symlink", [dict(first, file="link.bin")], "cannot be opened as a file"),
        ("a FIFO", [dict(first, file="fifo.bin")], "not a regular file"),
        ("a directory", [dict(first, file="dir.bin")], "chunk file 'dir.bin' in .* is not a regular file"),
        ("non-finite values", [dict(first, file="nan.bin")], r"chunk file 'nan.bin': tensor .* holds \d+ non-finite"),
        ("a missing file", [dict(first, file="nothing.bin")], "does not exist"),
        ("a size mismatch", [short], "holds .* bytes"),
        ("a bad dtype name", [dict(first, dtype_names=["float64"] + first["dtype_names"][1:])], "float64"),
        ("shapes not matching sizes", [dict(first, shapes=[[1]] + first["shapes"][1:])], "do not match shape"),
        ("a name not in the checkpoint", [dict(first, names=["lm_head.nope"] + first["names"][1:])], "not in the"),
        ("a good chunk, then a repeated one", [first, first], "came twice"),
        ("a good chunk, then a bad one", [*rest[:1], dict(first, file="../x")], "plain file name"),
    ]


@SHARES_THE_SERVER
@pytest.mark.vllm
def test_refused_pushes_leave_the_served_weights_and_a_good_round_follows(server, tiny_dir, tmp_path):
    url, directory = server
    _push(url, directory, _named(_perturbed(tiny_dir, seed=3)), "step-3")
    ids, served = _generate(url)
    for what, chunks, refusal in _crafted_rounds(tiny_dir, directory, tmp_path):
        _ok(url, "/pause?mode=wait", method="POST")
        _ok(url, "/start_weight_update", method="POST")
        statuses = [_request(url, "/update_weights", {"update_info": chunk}) for chunk in chunks]
        *accepted, (status, answer) = statuses
        assert all(code == 200 for code, _ in accepted), (what, accepted)
        assert status == 500, (what, status, answer)
        assert re.search(refusal, answer["error"]["message"]), (what, answer)
        # vLLM closed the round with the failed chunk: finishing it is refused, the version stays.
        assert _request(url, "/finish_weight_update", {"weight_version": "bad"})[0] == 500
        _ok(url, "/resume", method="POST")
        assert _request(url, "/health", token=None)[0] == 200, what
        assert _same(_generate(url), (ids, served)), what
        assert _ok(url, "/weight_info") == {"weight_version": "step-3"}, what
    _clear(directory)
    os.rmdir(directory / "dir.bin")

    # A round that lacks tensors is refused at its finish; a second finish closes it, the model untouched.
    model = _perturbed(tiny_dir, seed=4)
    _ok(url, "/pause?mode=wait", method="POST")
    _ok(url, "/start_weight_update", method="POST")
    for info in write_chunks(_named(model)[:-1], directory, chunk_bytes=100_000):
        _ok(url, "/update_weights", {"update_info": info})
    status, answer = _request(url, "/finish_weight_update", {"weight_version": "partial"})
    assert status == 500 and "lacks 1 of the checkpoint's" in answer["error"]["message"], answer
    _ok(url, "/finish_weight_update", method="POST")
    _ok(url, "/resume", method="POST")
    _clear(directory)
    assert _same(_generate(url), (ids, served))
    assert _ok(url, "/weight_info") == {"weight_version": "step-3"}

    _push(url, directory, _named(model), "step-4")
    assert _ok(url, "/weight_info") == {"weight_version": "step-4"}
    new_ids, new = _generate(url)
    assert (new.double() - _hf_logprobs(model, new_ids)).abs().max() < 1e-5


def _same(a, b) -> bool:
    return a[0] == b[0] and torch.equal(a[1], b[1])


@SHARES_THE_SERVER
@pytest.mark.vllm
def test_the_transfer_directory_must_be_absolute_and_private(server, tiny_dir, tmp_path):
    url, directory = server
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    for given, refusal in [(str(shared), "writable by other users"), ("relative/dir", "must be an absolute path")]:
        status, answer = _request(url, "/init_weight_transfer_engine", {"init_info": {"directory": given}})
        assert status == 500 and refusal in answer["error"]["message"], (given, answer)
    # The refused directories did not replace the one in use: a push through it still works.
    _push(url, directory, _named(_perturbed(tiny_dir, seed=5)), "step-5")
    assert _ok(url, "/weight_info") == {"weight_version": "step-5"}


# ---- a second local user, and weights that went wrong ----


def _engine(url: str, transfer_dir: str | None = None):
    """The trainer's side of the push (``ServerRolloutEngine``), against the module's server."""
    from stare_lightning.rollout.server.trainer_side.client import ServerClient
    from stare_lightning.rollout.server.trainer_side.engine import ServerRolloutEngine

    client = ServerClient(url, token=TOKEN, timeout=HTTP_TIMEOUT_S)
    return ServerRolloutEngine([client], chunk_bytes=100_000, transfer_dir=transfer_dir)


def _back_to_the_fixture_directory(url: str, directory: Path) -> None:
    """The engine's pushes moved the server to its own directory; the module's other tests use the fixture's."""
    _ok(url, "/init_weight_transfer_engine", {"init_info": {"directory": str(directory)}})


@SHARES_THE_SERVER
@pytest.mark.vllm
def test_a_non_finite_weight_never_leaves_the_trainer(server, tiny_dir):
    url, directory = server
    from stare_lightning.rollout.weights import NonFiniteWeights

    engine = _engine(url)
    try:
        model = _perturbed(tiny_dir, seed=6)
        engine.sync_weights(model)  # a good push first, through the run's own directory and code path
        assert _ok(url, "/weight_info") == {"weight_version": "push-1"}
        ids, served = _generate(url)
        assert (served.double() - _hf_logprobs(model, ids)).abs().max() < 1e-5
        name, param = list(model.named_parameters())[3]
        with torch.no_grad():
            param.view(-1)[:2] = torch.tensor([float("nan"), float("inf")])
        refusal = rf"weight '{re.escape(name)}' of the policy after step 7 holds 2 non-finite values .* not pushed"
        with pytest.raises(NonFiniteWeights, match=refusal):
            engine.gather_weights(model, policy="the policy after step 7")
        with pytest.raises(NonFiniteWeights, match=rf"weight '{re.escape(name)}' of the policy of weight push 2"):
            engine.sync_weights(model)  # gathered and pushed at once: refused before a server is paused
        assert _ok(url, "/is_paused") == {"is_paused": False}
        assert _ok(url, "/weight_info") == {"weight_version": "push-1"}
        assert _same(_generate(url), (ids, served))
        assert engine._transfer_dir.names() == []  # the chunks written before the refusal are gone
    finally:
        engine.close()
        _back_to_the_fixture_directory(url, directory)


@SHARES_THE_SERVER
@pytest.mark.vllm
def test_a_transfer_directory_of_another_user_is_refused_though_private(server, other_user, shared_scratch):
    """Racing the first push, another user could offer a directory of their own: its mode passes, its owner does not."""
    url, _ = server
    theirs = shared_scratch / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, other_user.uid, other_user.gid)
    assert not theirs.stat().st_mode & 0o022  # the control: the mode check alone took it
    status, answer = _request(url, "/init_weight_transfer_engine", {"init_info": {"directory": str(theirs)}})
    assert (
        status == 500 and f"is owned by uid {other_user.uid}, not by this server's user" in answer["error"]["message"]
    )


@SHARES_THE_SERVER
@pytest.mark.vllm
def test_a_transfer_directory_swapped_mid_run_ends_the_push_in_one_line(server, tiny_dir, other_user, shared_scratch):
    """``rollout.server.transfer_dir`` (root's, 0755) in a directory another user owns: after the first push that
    user renames it away and plants a directory of the run's name with a link to a root-owned file. The next push
    stops, saying the directory was replaced; the file keeps its bytes; the server keeps the first push's weights."""
    from stare_lightning.rollout.transfer_dir import UnsafeTransferDirectory

    url, directory = server
    parent = shared_scratch / "project"
    parent.mkdir(mode=0o755)
    os.chown(parent, other_user.uid, other_user.gid)
    (parent / "weights").mkdir(mode=0o755)
    victim = shared_scratch / "victim"
    victim.write_bytes(b"root's file")
    engine = _engine(url, transfer_dir=str(parent / "weights"))
    try:
        engine.sync_weights(_perturbed(tiny_dir, seed=8))
        path = engine._transfer_dir.path
        served = _generate(url)
        swapped = other_user.run(
            f"""
parent, name, victim = {str(parent)!r}, {path.name!r}, {str(victim)!r}
os.rename(parent + "/weights", parent + "/weights-moved")
os.makedirs(parent + "/weights/" + name)
for k in range(8):
    os.symlink(victim, parent + "/weights/" + name + "/chunk-%d.bin" % k)
print(json.dumps({{"renamed": os.path.isdir(parent + "/weights-moved/" + name)}}))
"""
        )
        # The control: the rename worked, and a write by path would follow the planted link to root's file.
        assert swapped == {"renamed": True} and os.path.realpath(path / "chunk-0.bin") == str(victim)
        with pytest.raises(UnsafeTransferDirectory) as refused:
            engine.sync_weights(_perturbed(tiny_dir, seed=9))
        assert f"the weight-transfer directory {path} was replaced" in str(refused.value)
        assert "\n" not in str(refused.value) and isinstance(refused.value, OSError)  # user_errors: one line
        assert victim.read_bytes() == b"root's file"
        assert _ok(url, "/weight_info") == {"weight_version": "push-1"} and _same(_generate(url), served)
    finally:
        engine.close()
        _back_to_the_fixture_directory(url, directory)


@SHARES_THE_SERVER
@pytest.mark.vllm
def test_a_cpu_server_forks_its_engine_core_instead_of_spawning_an_interpreter(server):
    """vLLM's CPU platform would spawn the engine core, a fresh interpreter importing vLLM again; multiprocessing
    starts its resource tracker, one more interpreter, for a spawn and not for a fork. The launched server has one
    process below it, its engine core, and it serves (every test of this module samples from it)."""
    import psutil

    path = server[0].removeprefix("unix:")
    serving = {p.pid: p for p in psutil.process_iter(["cmdline"]) if path in (p.info["cmdline"] or [])}
    (api,) = [p for p in serving.values() if p.ppid() not in serving]  # a fork keeps its parent's command line
    below = api.children(recursive=True)
    assert len(below) == 1, [child.cmdline() for child in below]
    assert not any("multiprocessing" in " ".join(child.cmdline()) for child in below)


FLOOD_ATTEMPTS = 2000  # connections the other user tries to open to the server, spread over FLOOD_SECONDS
FLOOD_SECONDS = 5.0
FLOOD_DEADLINE_S = 30.0  # the flood stops here whatever it reached
HELD_ON_TCP = 200  # half-open connections the other user holds on a loopback TCP socket: its flood works
HALF_OPEN = b"GET /health HTTP/1.1\r\nHost: localhost\r\n"  # headers that never finish


@SHARES_THE_SERVER
@pytest.mark.vllm
def test_a_flood_of_half_open_connections_from_another_user_never_reaches_the_server(server, other_user):
    """The stock server has no timeout for headers that never finish, so whoever can connect can hold its connections
    and exhaust its file descriptors. A launched server's socket lies in a directory only the run's user may enter:
    another user's flood is refused by the kernel before a connection exists, and the trainer's requests go on."""
    url, _ = server
    path = http.unix_socket_path(url)
    # The control, part one: connections the server holds open with unfinished headers, past uvicorn's keep-alive
    # timeout (vLLM's default: 5 s). Nothing closes them: any user who reaches the socket can pile them up.
    held = []
    for _ in range(20):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(path)
        sock.sendall(HALF_OPEN)
        held.append(sock)
    time.sleep(7)
    still_open = 0
    for sock in held:
        try:
            still_open += sock.recv(1, socket.MSG_DONTWAIT) != b""
        except BlockingIOError:  # no answer and not closed: the server is still waiting for the headers
            still_open += 1
        sock.close()
    assert still_open == 20

    ids, served = _generate(url)
    with socket.socket() as listener:  # the control, part two: a loopback TCP socket any local user may reach
        listener.bind(("127.0.0.1", 0))
        listener.listen(HELD_ON_TCP + 50)
        flood = other_user.start(
            f"""
path, port, deadline = {path!r}, {listener.getsockname()[1]}, time.monotonic() + {FLOOD_DEADLINE_S}
attempts, connected, refusals, held = 0, 0, {{}}, []
for _ in range({HELD_ON_TCP}):
    sock = socket.socket()
    sock.settimeout(5)
    sock.connect(("127.0.0.1", port))
    sock.sendall({HALF_OPEN!r})
    held.append(sock)
while attempts < {FLOOD_ATTEMPTS} and time.monotonic() < deadline:
    attempts += 1
    if attempts % 100 == 0:  # in bursts, so the flood lasts while the trainer's requests run
        time.sleep({FLOOD_SECONDS * 100 / FLOOD_ATTEMPTS})
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
        sock.sendall({HALF_OPEN!r})
        held.append(sock)
        connected += 1
    except OSError as error:
        refusals[errno.errorcode[error.errno]] = refusals.get(errno.errorcode[error.errno], 0) + 1
        sock.close()
print(json.dumps({{"attempts": attempts, "connected": connected, "refusals": refusals,
                  "held_on_tcp": len(held) - connected}}))
"""
        )
        answered = 0
        while flood.poll() is None or answered == 0:  # the trainer's requests while the flood runs
            assert _same(_generate(url), (ids, served))
            answered += 1
        report = other_user.finish(flood)
    assert report["held_on_tcp"] == HELD_ON_TCP  # the flood works where the other user can connect...
    assert report["attempts"] == FLOOD_ATTEMPTS and report["connected"] == 0  # ...and opened nothing here
    assert report["refusals"] == {"EACCES": FLOOD_ATTEMPTS}
    assert answered >= 1 and _request(url, "/health", token=None)[0] == 200


@SHARES_THE_SERVER
@pytest.mark.vllm
def test_a_server_started_without_runtime_lora_is_named_with_the_fix(server, tmp_path):
    """The module's server has no LoRA flags, so no adapter routes: the trainer says what to start it with."""
    from stare_lightning.rollout.server.trainer_side.client import RolloutServerError, ServerClient

    client = ServerClient(server[0], token=TOKEN, timeout=HTTP_TIMEOUT_S)
    with pytest.raises(RolloutServerError, match="--enable-lora .* VLLM_ALLOW_RUNTIME_LORA_UPDATING") as info:
        client.load_adapter("policy-v1", str(tmp_path))
    assert str(tmp_path) in str(info.value) and "HTTP 40" in str(info.value)  # the path and the server's answer


# ---- the network transfer, on the same server ----


def _network_engine(url: str):
    """The trainer's side with ``rollout.server.transfer=network``: its own rendezvous on loopback."""
    from stare_lightning.rollout.server.trainer_side.client import ServerClient
    from stare_lightning.rollout.server.trainer_side.engine import ServerRolloutEngine
    from stare_lightning.rollout.server.trainer_side.net_push import NetworkPush

    client = ServerClient(url, token=TOKEN, timeout=HTTP_TIMEOUT_S)
    network = NetworkPush([client], token=TOKEN, address="127.0.0.1", port=0, timeout=HTTP_TIMEOUT_S)
    return ServerRolloutEngine([client], chunk_bytes=100_000, network=network)


@SHARES_THE_SERVER
@pytest.mark.vllm
def test_a_network_push_serves_the_pushed_weights_and_bytes_not_the_trainers_are_refused(tcp_server, tiny_dir):
    """A round whose bytes differ from those its digest covers (bytes injected on the wire), or whose digest was made
    without the run's secret, is refused at its first chunk: the server keeps its weights. The control: the same
    round untouched is served."""
    from stare_lightning.rollout.server.shared.net_wire import pack_chunks
    from stare_lightning.rollout.server.trainer_side.client import RolloutServerError

    url, directory = tcp_server
    engine = _network_engine(url)
    try:
        model = _perturbed(tiny_dir, seed=21)
        engine.sync_weights(model)
        assert _ok(url, "/weight_info") == {"weight_version": "push-1"} and engine.last_sync_bytes > 0
        ids, served = _generate(url)
        assert (served.double() - _hf_logprobs(model, ids)).abs().max() < 1e-5
        assert not list(directory.iterdir())  # nothing went through files

        other = _named(_perturbed(tiny_dir, seed=22))
        injected = list(pack_chunks(other, TOKEN, 100_000))
        injected[0][1][5] ^= 1  # one bit of the first chunk, after its digest was taken
        forged = list(pack_chunks(other, "a-stranger-without-the-secret-" + "q" * 10, 100_000))
        for chunks in (injected, forged):
            with pytest.raises(RolloutServerError, match=f"{url}.*do not match the digest the trainer sent"):
                engine.network.push(chunks, "forged")
            # vLLM closed the round with the refused chunk: finishing it is refused too, the version stays.
            assert _request(url, "/finish_weight_update", {"weight_version": "forged"})[0] == 500
            _ok(url, "/resume", method="POST")
            assert _ok(url, "/weight_info") == {"weight_version": "push-1"}
            assert _same(_generate(url), (ids, served))
        engine.network.push(list(pack_chunks(other, TOKEN, 100_000)), "genuine")  # the control (new groups)
        assert _ok(url, "/weight_info") == {"weight_version": "genuine"}
        assert not _same(_generate(url), (ids, served))
    finally:
        engine.close()
        _back_to_the_fixture_directory(url, directory)


STALL_TIMEOUT_S = 10.0


@SHARES_THE_SERVER
@pytest.mark.vllm
def test_a_network_push_cut_mid_round_is_refused_within_the_timeout_and_never_served(tcp_server, tiny_dir):
    """The trainer's bytes stop after the first chunk (a cut link, a trainer gone): the server's receive gives up
    after the timeout the trainer set, the round is refused, and the server serves its previous version."""
    import threading

    from stare_lightning.rollout.server.shared.net_wire import pack_chunks
    from stare_lightning.rollout.server.trainer_side.client import RolloutServerError, ServerClient
    from stare_lightning.rollout.server.trainer_side.net_push import NetworkPush

    url, directory = tcp_server
    client = ServerClient(url, token=TOKEN, timeout=HTTP_TIMEOUT_S)
    network = NetworkPush([client], token=TOKEN, address="127.0.0.1", port=0, timeout=STALL_TIMEOUT_S)
    try:
        network.push(list(pack_chunks(_named(_perturbed(tiny_dir, seed=31)), TOKEN, 100_000)), "whole")
        ids, served = _generate(url)
        chunks = list(pack_chunks(_named(_perturbed(tiny_dir, seed=32)), TOKEN, 100_000))
        assert len(chunks) > 2
        (group,) = network._groups
        client.begin_push()
        first = threading.Thread(target=group.send, args=(chunks[0][1],), daemon=True)
        first.start()
        client.send_chunk(chunks[0][0])
        start = time.monotonic()
        with pytest.raises(RolloutServerError, match=f"{url} refused .*receiving a weight chunk from the trainer"):
            client.send_chunk(chunks[1][0])  # its bytes never come
        assert time.monotonic() - start < STALL_TIMEOUT_S + 30
        assert _request(url, "/finish_weight_update", {"weight_version": "partial"})[0] == 500
        _ok(url, "/resume", method="POST")
        assert _ok(url, "/weight_info") == {"weight_version": "whole"}
        assert _same(_generate(url), (ids, served))
    finally:
        network.close()
        _back_to_the_fixture_directory(url, directory)
