"""``rollout=server``'s settings: what each refuses where it would do nothing, and a server that does not answer
stopping the run before its first step with one line naming it."""

from __future__ import annotations

import os
import socket

import pytest

from stare_lightning.rollout.config import RolloutConfig
from stare_lightning.rollout.server.trainer_side.client import RolloutServerError
from stare_lightning.rollout.server.trainer_side.connect import connect_servers
from stare_lightning.rollout.server_config import ServerConfig
from tests import forked_cli


def _closed_port() -> int:
    """A port nothing listens on (bound, read, released)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_the_server_group_composes(tmp_path):
    from stare_lightning.cli import compose, prepare_config

    run = prepare_config(compose(["rollout=server", f"output_dir={tmp_path}"]))[1]
    assert run.rollout.backend == "server" and run.rollout.server.launch and run.rollout.server.host == "unix"


@pytest.mark.parametrize(
    "server, backend, message",
    [
        (dict(launch=False), "server", "rollout.server.launch=false needs rollout.server.urls"),
        (dict(launch=False, urls=["http://a:1"], count=2), "server", "rollout.server.count does nothing with"),
        (dict(launch=False, urls=["http://a:1"], cpus=["0"]), "server", "rollout.server.cpus does nothing with"),
        (dict(urls=["http://a:1"]), "server", "rollout.server.urls does nothing with rollout.server.launch=true"),
        (dict(count=2, cpus=["0"]), "server", "rollout.server.cpus has 1 entries for rollout.server.count=2"),
        (dict(launch=False, urls=["a:1"]), "server", "must be a base URL"),
        (dict(launch=False, urls=["unix:relative.sock"]), "server", "must be a base URL"),
        (dict(port=8000), "server", "rollout.server.port=8000 does nothing with rollout.server.host=unix"),
        (dict(token_env="not a name"), "server", "rollout.server.token_env"),
        (dict(gpu_memory_utilization=1.5), "server", "rollout.server.gpu_memory_utilization"),
        (
            dict(launch=False, urls=["http://a:1"], gpu_memory_utilization=0.5),
            "server",
            "rollout.server.gpu_memory_utilization does nothing with",
        ),
        (dict(count=2), "vllm", "rollout.server settings do nothing with rollout.backend=vllm"),
    ],
)
def test_settings_that_would_do_nothing_are_refused(server, backend, message):
    with pytest.raises(ValueError, match=message.replace(".", r"\.").replace("[", r"\[")):
        RolloutConfig(backend=backend, server=ServerConfig(**server))


@pytest.mark.parametrize("backend", ["vllm", "hf", "auto"])
def test_staleness_is_refused_without_servers(backend):
    with pytest.raises(ValueError, match="rollout.max_staleness=1 does nothing with rollout.backend="):
        RolloutConfig(backend=backend, max_staleness=1)
    with pytest.raises(ValueError, match="rollout.max_staleness"):
        RolloutConfig(backend="server", max_staleness=-1)
    assert RolloutConfig(backend="server", max_staleness=2).max_staleness == 2
    assert RolloutConfig(backend="server", max_staleness=8).max_staleness == 8
    with pytest.raises(ValueError, match=r"max_staleness=9 is out of range: must be an integer in \[0, 8\].*K \+ 1"):
        RolloutConfig(backend="server", max_staleness=9)


def test_servers_on_unix_sockets_are_reached_by_unix_urls():
    server = ServerConfig(launch=False, urls=["unix:/dev/shm/servers/0.sock"])
    assert RolloutConfig(backend="server", server=server).server.urls == ["unix:/dev/shm/servers/0.sock"]
    assert RolloutConfig(backend="server", server=ServerConfig(host="127.0.0.1", port=8000)).server.port == 8000


@pytest.mark.parametrize(
    ("value", "refusal"),
    [
        ("abc", r"rollout.max_staleness='abc' is not allowed: must be an integer in \[0, 8\]"),
        ("1.5", r"rollout.max_staleness=1.5 is not allowed: must be an integer in \[0, 8\]"),
        ("1000", r"rollout.max_staleness=1000 is out of range: must be an integer in \[0, 8\] .*K \+ 1 full copies"),
    ],
)
def test_max_staleness_on_the_command_line_is_named_before_hydra_merges_it(tmp_path, value, refusal):
    import re

    from stare_lightning.cli import compose

    command = ["fit", "rollout=server", f"rollout.max_staleness={value}", f"output_dir={tmp_path / 'run'}"]
    done = forked_cli.run(command, cwd=tmp_path, timeout=300)
    assert done.returncode == 2
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and re.search(refusal, errors[0]), done.stderr[-2000:]
    if value != "1000":  # the control: composed as it was, Hydra's merge error says nothing of what the key takes
        with pytest.raises(Exception) as generic:
            compose(["rollout=server", f"rollout.max_staleness={value}"])
        assert "must be an integer in" not in str(generic.value) and "max_staleness" in str(generic.value)


@pytest.mark.parametrize(
    ("token", "refusal"),
    [("", "is blank"), ("   ", "is blank"), ("x", "has 1 characters; a server credential needs at least 32"),
     ("a" * 31, "has 31 characters"), ("a" * 30 + " b", "holds whitespace")],
)  # fmt: skip
def test_a_launched_run_refuses_a_weak_credential_before_starting_a_server(tmp_path, monkeypatch, token, refusal):
    monkeypatch.setenv("STARE_LIGHTNING_SERVER_TOKEN", token)
    with pytest.raises(ValueError, match=rf"\$STARE_LIGHTNING_SERVER_TOKEN {refusal}") as refused:
        connect_servers(ServerConfig(), "unused", dtype="float32", seed=0, log_dir=tmp_path / "servers")
    assert not (tmp_path / "servers").exists()  # nothing was started
    assert token.strip() == "" or token not in str(refused.value)  # the message never repeats the token


@pytest.mark.parametrize(("token", "refusal"), [("   ", "is blank"), ("short-secret", "has 12 characters")])
def test_serve_refuses_a_weak_credential_in_one_line_before_anything_starts(tmp_path, token, refusal):
    env = {**os.environ, "STARE_LIGHTNING_SERVER_TOKEN": token, "STARE_LIGHTNING_CACHE": str(tmp_path / "cache")}
    command = ["serve", "rollout=server", "rollout.server.host=0.0.0.0", f"output_dir={tmp_path / 'run'}"]
    done = forked_cli.run(command, cwd=tmp_path, env=env, timeout=300)
    assert done.returncode == 2
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and f"$STARE_LIGHTNING_SERVER_TOKEN {refusal}" in errors[0], done.stderr[-2000:]
    assert len(done.stderr.strip().splitlines()) == 1  # one line, no traceback
    assert not (tmp_path / "cache").exists() and not (tmp_path / "run" / "servers").exists()  # nothing started
    assert token.strip() == "" or token not in done.stdout + done.stderr


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(engine_kwargs={"max_num_seqs": 4}), "rollout.engine_kwargs"),
        (dict(enable_sleep_mode=True), "rollout.enable_sleep_mode and rollout.tensor_parallel_size do nothing"),
        (dict(tensor_parallel_size=2), "rollout.enable_sleep_mode and rollout.tensor_parallel_size do nothing"),
        (dict(gpu_memory_utilization=0.5), "rollout.server.gpu_memory_utilization"),
    ],
)
def test_in_process_engine_settings_are_refused_with_servers(settings, message):
    with pytest.raises(ValueError, match=message):
        RolloutConfig(backend="server", **settings)


def test_a_servers_gpu_share_reaches_its_command_line(tmp_path, monkeypatch):
    """``rollout.server.gpu_memory_utilization`` becomes the launched server's ``--gpu-memory-utilization``."""
    from stare_lightning.rollout.server.trainer_side import connect
    from stare_lightning.rollout.server.trainer_side.launch import LaunchedServers

    commands = []
    monkeypatch.setattr(LaunchedServers, "start", lambda self: commands.extend(map(self.command, self.specs)))
    for share, expected in ((0.45, ["--gpu-memory-utilization", "0.45"]), (None, [])):
        commands.clear()
        server = ServerConfig(host="127.0.0.1", gpus=["0"], gpu_memory_utilization=share)
        connect.launch_servers(server, str(tmp_path), dtype="bfloat16", seed=0, log_dir=tmp_path, token="t" * 32)
        (command,) = commands
        flag = [
            arg
            for i, arg in enumerate(command)
            if arg == "--gpu-memory-utilization" or (i and command[i - 1] == "--gpu-memory-utilization")
        ]
        assert flag == expected


def test_a_server_that_does_not_answer_is_named_before_anything_runs(tmp_path):
    url = f"http://127.0.0.1:{_closed_port()}"
    with pytest.raises(RolloutServerError, match=f"rollout server {url} does not answer its health check"):
        connect_servers(ServerConfig(launch=False, urls=[url]), "unused", dtype="float32", seed=0, log_dir=tmp_path)
    assert isinstance(RolloutServerError("x"), OSError)  # reported as one line, like any unreachable resource


@pytest.mark.slow
def test_the_cli_stops_before_the_model_is_prepared_naming_the_server(tmp_path):
    url = f"http://127.0.0.1:{_closed_port()}"
    env = {**os.environ, "STARE_LIGHTNING_CACHE": str(tmp_path / "cache")}
    command = ["fit", "rollout=server", "rollout.server.launch=false", f"rollout.server.urls=[{url}]",
               f"output_dir={tmp_path / 'run'}", "trainer.max_steps=2"]  # fmt: skip
    done = forked_cli.run(command, cwd=tmp_path, env=env, timeout=600)
    assert done.returncode != 0
    errors = [line for line in (done.stdout + done.stderr).splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and f"rollout server {url} does not answer its health check" in errors[0], errors
    assert not list((tmp_path / "run").rglob("*.ckpt"))  # no step ran
    assert not (tmp_path / "cache").exists()  # nor was the model prepared


def test_serve_refuses_a_network_address_without_a_credential(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "STARE_LIGHTNING_SERVER_TOKEN"}
    env["STARE_LIGHTNING_CACHE"] = str(tmp_path / "cache")
    command = ["serve", "rollout=server", "rollout.server.host=0.0.0.0", f"output_dir={tmp_path / 'run'}"]
    done = forked_cli.run(command, cwd=tmp_path, env=env, timeout=300)
    assert done.returncode != 0
    assert "rollout.server.host=0.0.0.0 listens on a network: set STARE_LIGHTNING_SERVER_TOKEN" in done.stderr
