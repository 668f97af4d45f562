"""The network weight push's group and wire format, with real processes and no vLLM: a process that knows the
trainer's address, port and nonce but not the run's secret never joins the trainer's group (and one that knows the
secret does, the control); a chunk's bytes round-trip bit exactly and its digest binds them to the secret; what
``rollout.server.transfer=auto`` picks, and what the config refuses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from stare_lightning.rollout.server.shared.net_group import TRAINER_RANK, TransferGroup, host_store
from stare_lightning.rollout.server.shared.net_wire import chunk_digest, new_nonce, pack_chunks, rendezvous_prefix
from stare_lightning.rollout.server.trainer_side.placement import transfer_mode
from stare_lightning.rollout.server_config import ServerConfig

TOKEN = "network-test-token-" + "0123456789" * 3
# Both sides join once their imports are done, so the control meets well within it; the stranger's case waits it out.
JOIN_TIMEOUT_S = 5.0

# A server's worker as net_receive.py runs it, in a process of its own: joins the group the init names, receives one
# chunk and prints what it got (or the refusal). It joins once told to, after its imports: a loaded machine's slow
# start does not eat into the join's timeout.
WORKER = """
import json, sys
from stare_lightning.rollout.server.in_vllm.net_receive import NetworkReceiver
init, info = json.loads(sys.argv[1]), json.loads(sys.argv[2])
print("ready", flush=True)
sys.stdin.readline()
try:
    _, tensors = NetworkReceiver(init).receive(info)
    print(json.dumps({name: tensor.tolist() for name, tensor in tensors.items()}))
except Exception as error:
    print(json.dumps({"refused": f"{type(error).__name__}: {error}"}))
"""


def _weights() -> list[tuple[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    return [
        ("a.weight", torch.randn(3, 5, generator=generator)),
        ("b.bias", torch.randn(7, generator=generator).to(torch.bfloat16)),
        ("c.weight", torch.randn(2, 2, generator=generator)),  # after 7 bf16 values: an odd offset in the buffer
    ]


def _worker(init: dict, info: dict, token: str) -> subprocess.Popen:
    env = {**os.environ, "STARE_LIGHTNING_SERVER_TOKEN": token}
    return subprocess.Popen(
        [sys.executable, "-c", WORKER, json.dumps(init), json.dumps(info)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )


def _trainer_side(store, nonce: str, buffer: torch.Tensor) -> dict:
    """Join member 0's group and send ``buffer``, on a thread; the outcome lands in the returned dict."""
    outcome: dict = {}

    def run() -> None:
        try:
            group = TransferGroup(store, rendezvous_prefix(TOKEN, nonce, 0), TRAINER_RANK, "127.0.0.1", JOIN_TIMEOUT_S)
            group.send(buffer)
            outcome["sent"] = True
        except RuntimeError as error:
            outcome["error"] = str(error)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    outcome["thread"] = thread
    return outcome


@pytest.mark.parametrize("knows_the_secret", [True, False])
def test_only_a_process_with_the_secret_joins_the_trainers_group(knows_the_secret):
    ((info, buffer),) = pack_chunks(_weights(), TOKEN, chunk_bytes=1 << 20)
    store, nonce = host_store("127.0.0.1", 0, JOIN_TIMEOUT_S), new_nonce()
    init = {"address": "127.0.0.1", "port": store.port, "nonce": nonce, "member": 0, "timeout_s": JOIN_TIMEOUT_S}
    # The stranger knows everything the init request carries (address, port, nonce, member), not the secret.
    worker = _worker(init, info, TOKEN if knows_the_secret else "not-the-secret-" + "x" * 30)
    assert worker.stdout.readline().strip() == "ready"
    start = time.monotonic()
    trainer = _trainer_side(store, nonce, buffer)
    answer = json.loads(worker.communicate("join\n", timeout=120)[0])
    trainer["thread"].join(60)
    if knows_the_secret:  # the control: the same process with the secret joins and gets the trainer's bytes
        assert trainer.get("sent") and "refused" not in answer, (trainer, answer)
        for name, tensor in _weights():
            assert torch.equal(torch.tensor(answer[name], dtype=tensor.dtype), tensor), name
    else:
        assert "joining the trainer's weight-transfer group at 127.0.0.1" in answer["refused"], answer
        assert "sent" not in trainer and trainer["error"], trainer  # the trainer never met it: its join timed out
        assert time.monotonic() - start < 120


def test_the_digest_binds_a_chunks_bytes_and_description_to_the_secret():
    ((info, buffer),) = pack_chunks(_weights(), TOKEN, chunk_bytes=1 << 20)
    assert chunk_digest(TOKEN, info, buffer.numpy().data) == info["digest"]
    flipped = buffer.clone()
    flipped[3] ^= 1
    assert chunk_digest(TOKEN, info, flipped.numpy().data) != info["digest"]
    assert chunk_digest("another-token-" + "y" * 30, info, buffer.numpy().data) != info["digest"]
    renamed = dict(info, names=["c.weight", "b.bias", "a.weight"])
    assert chunk_digest(TOKEN, renamed, buffer.numpy().data) != info["digest"]
    # The prefix differs by secret, nonce and member.
    nonce = new_nonce()
    variants = [(TOKEN, nonce, 0), (TOKEN, nonce, 1), (TOKEN, new_nonce(), 0), ("z" * 40, nonce, 0)]
    assert len({rendezvous_prefix(*variant) for variant in variants}) == 4


@pytest.mark.parametrize(
    ("settings", "mode"),
    [
        ({}, "files"),  # launched servers are on this host
        ({"launch": False, "urls": ["unix:/tmp/x.sock", "http://127.0.0.1:8000", "http://localhost:1"]}, "files"),
        ({"launch": False, "urls": ["http://127.0.0.1:8000", "http://192.0.2.7:8000"]}, "network"),  # TEST-NET-1
        ({"launch": False, "urls": ["http://192.0.2.7:8000"], "transfer_dir": "/shared"}, "files"),
        ({"launch": False, "urls": ["http://192.0.2.7:8000"], "transfer": "files"}, "files"),
        ({"transfer": "network", "host": "127.0.0.1"}, "network"),
    ],
)
def test_auto_picks_the_network_for_a_server_on_another_host(settings, mode):
    server = ServerConfig(**settings)
    server.check("server")
    assert transfer_mode(server) == mode


@pytest.mark.parametrize(
    ("settings", "refusal"),
    [
        ({"transfer": "disk"}, "transfer='disk' is not allowed: choose one of .'auto', 'files', 'network'."),
        ({"transfer": "files", "transfer_port": 9000}, "transfer_port does nothing with rollout.server.transfer=files"),
        ({"transfer": "network", "host": "127.0.0.1", "transfer_dir": "/shared"}, "transfer_dir does nothing with"),
        ({"transfer_address": " "}, "transfer_address=' ' is not allowed"),
        ({"transfer": "network"}, "transfer=network cannot reach servers on Unix sockets"),  # launched on unix
        ({"transfer": "network", "launch": False, "urls": ["unix:/run/a.sock"]}, "cannot reach servers on Unix"),
    ],
)
def test_transfer_settings_that_cannot_work_are_refused(settings, refusal):
    with pytest.raises(ValueError, match=refusal):
        ServerConfig(**settings).check("server")
