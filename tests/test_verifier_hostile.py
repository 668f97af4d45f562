"""Code running in the verifier worker talks to the trainer only in data: it cannot run code there, nor stall it.

Each attack is a real user verifier, imported by the worker from a module under ``tmp_path``, that reaches the
worker's end of its channel to the trainer (a ``multiprocessing`` Connection found through ``gc``, else the raw
socket descriptors listed in ``/proc/self/fd``) and writes into it: a pickle whose unpickling would create a marker
file in the trainer, bytes that are not a message, a frame too long to be read, messages of a wrong shape, half a
frame. Each time the trainer must run nothing, score the items the worker had reached 0 as errors, and go on with
a fresh worker.
"""

from __future__ import annotations

import os
import sys
import time

import pytest

from stare_lightning.rewards import VerifierPool

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the verifier worker's confinement is Linux's")

CD = {"numbers": [3, 5, 7], "target": 22, "ops": "+-*"}
GOOD = ("countdown", "3*5+7", "22", CD)
TIMEOUT_S = 3.0
# A stalled exchange is cut by the per-item limit; on top of it: stopping the worker and the poll interval (well
# under a second), doubled and rounded up for a loaded machine.
SLACK_S = 5.0

ATTACKS = r'''
import gc
import json
import os
import pickle
import struct
import time


class Payload:
    """Unpickling this calls open(MARK, "w"): the file appears wherever it is unpickled."""

    def __init__(self, mark):
        self.mark = mark

    def __reduce__(self):
        return (open, (self.mark, "w"))


def _connections():
    from multiprocessing.connection import Connection

    return [obj for obj in gc.get_objects() if isinstance(obj, Connection) and not obj.closed]


def _socket_descriptors():
    found = []
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                found.append(int(name))
        except OSError:
            continue
    return found


def _write_raw(data):
    for fd in _socket_descriptors():
        os.write(fd, data)


def _frame(payload):
    return struct.pack("!Q", len(payload)) + payload


def send_pickle(response, answer, metadata):
    """The object goes the way the trainer reads: a Connection's send if there is one, else a frame on the socket."""
    connections = _connections()
    if connections:
        for connection in connections:
            connection.send(Payload(answer))
    else:
        _write_raw(_frame(pickle.dumps(Payload(answer))))
    return 1.0


def send_bytes(response, answer, metadata):
    """``answer`` names the bytes (hex) to write, unframed, into every socket of the worker."""
    _write_raw(bytes.fromhex(answer))
    return 1.0


def send_frame(response, answer, metadata):
    """``answer`` is a payload (text) sent as one well-framed message."""
    _write_raw(_frame(answer.encode()))
    return 1.0


def pause(response, answer, metadata):
    """An honest item that takes a moment: the trainer reads what came before it while the worker is still here."""
    time.sleep(float(response))
    return 1.0
'''


@pytest.fixture(scope="module")
def attacks(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hostile_verifiers")
    (folder / "channel_attacks.py").write_text(ATTACKS)
    folder.chmod(0o755)  # the worker runs as a uid of its own
    sys.path.insert(0, str(folder))
    yield "channel_attacks"
    sys.path.remove(str(folder))


@pytest.fixture(scope="module")
def pool(attacks):
    with VerifierPool(timeout_s=TIMEOUT_S) as p:
        assert p.score([GOOD]).scores == [1.0]
        yield p


def _pause(attacks: str) -> tuple:
    return (f"{attacks}:pause", "0.3", "", {})


def _assert_compromise_handled(result, hostile_index: int, batch_size: int) -> None:
    """The items the worker reached score 0 as errors (the hostile one among them), later items score normally."""
    zeros = result.scores.count(0.0)
    assert result.scores == [0.0] * zeros + [1.0] * (batch_size - zeros), result
    assert zeros > hostile_index, result
    assert result.errors == zeros and result.timeouts == 0, result
    assert any("broke the message protocol" in m for m in result.messages), result.messages


def _assert_still_works(pool: VerifierPool, starts_before: int) -> None:
    again = pool.score([GOOD] * 3)
    assert again.scores == [1.0, 1.0, 1.0] and again.errors == again.timeouts == 0
    assert pool.starts > starts_before  # by a fresh worker: the one that broke the protocol was stopped


def test_a_pickle_sent_from_the_worker_is_never_unpickled(pool, attacks, tmp_path):
    mark = tmp_path / "unpickled-in-the-trainer"
    starts = pool.starts
    batch = [GOOD, (f"{attacks}:send_pickle", "x", str(mark), {}), _pause(attacks), GOOD]
    result = pool.score(batch)
    assert not mark.exists(), "the trainer unpickled an object from the worker"
    _assert_compromise_handled(result, hostile_index=1, batch_size=len(batch))
    _assert_still_works(pool, starts)
    assert not mark.exists()


@pytest.mark.parametrize(
    "data",
    [
        pytest.param(b"\x00" * 7 + b"\x05hello", id="not-json"),
        pytest.param(os.urandom(64), id="random-bytes"),
        pytest.param((1 << 30).to_bytes(8, "big") + b"{}", id="a-1-GiB-frame"),
        pytest.param((70_000).to_bytes(8, "big") + b'{"kind": "done"' + b" " * 69_984 + b"}", id="over-64-KiB"),
    ],
)
def test_bytes_that_are_not_a_message_stop_the_worker(pool, attacks, data):
    starts = pool.starts
    batch = [(f"{attacks}:send_bytes", "x", data.hex(), {}), _pause(attacks), GOOD]
    result = pool.score(batch)
    _assert_compromise_handled(result, hostile_index=0, batch_size=len(batch))
    _assert_still_works(pool, starts)


@pytest.mark.parametrize(
    "payload",
    [
        pytest.param('{"kind": "shell", "cmd": "true"}', id="unknown-kind"),
        pytest.param('{"kind": "done", "extra": 1}', id="extra-field"),
        pytest.param('{"kind": "error", "index": -1, "text": "x"}', id="negative-index"),
        pytest.param('{"kind": "error", "index": 99, "text": "x"}', id="index-out-of-range"),
        pytest.param('{"kind": "error", "index": 0, "text": 5}', id="text-not-a-string"),
        pytest.param('{"kind": "error", "index": true, "text": "x"}', id="index-a-bool"),
        pytest.param('{"kind": "hello", "pid": 1, "confinement": {}}', id="hello-mid-batch"),
        pytest.param('{"kind": "done"}', id="done-before-the-end"),
        pytest.param('[{"kind": "done"}]', id="not-an-object"),
        pytest.param('{"kind": "error", "index": 0, "text": NaN}', id="nan"),
        pytest.param("[" * 50_000 + "]" * 10_000, id="deep-nesting"),
    ],
)
def test_messages_of_a_wrong_shape_stop_the_worker(pool, attacks, payload):
    starts = pool.starts
    batch = [GOOD, (f"{attacks}:send_frame", "x", payload, {}), _pause(attacks), GOOD]
    result = pool.score(batch)
    _assert_compromise_handled(result, hostile_index=1, batch_size=len(batch))
    _assert_still_works(pool, starts)


def test_half_a_frame_cannot_stall_the_trainer(pool, attacks):
    """A header that promises 100 bytes and 10 that come: the trainer never waits on the rest."""
    starts = pool.starts
    batch = [(f"{attacks}:send_bytes", "x", ((100).to_bytes(8, "big") + b"{" * 10).hex(), {}), GOOD]
    t0 = time.monotonic()
    result = pool.score(batch)
    elapsed = time.monotonic() - t0
    _assert_compromise_handled(result, hostile_index=0, batch_size=len(batch))
    assert elapsed < TIMEOUT_S + SLACK_S, elapsed  # cut by the per-item limit, not stalled on a read
    _assert_still_works(pool, starts)
