"""The verifier worker's wire format: framed messages, plain data from the worker, read without ever blocking.

Code that runs in the worker (a user verifier, or anything that got past the scoring guard) can reach the worker's
end of the socket, so what comes back is hostile: the trainer never unpickles it. Each frame is an 8-byte big-endian
length and a payload. Worker to trainer, the payload is UTF-8 JSON of one of three fixed shapes, each field checked
for type and range (``decode``):

- ``{"kind": "hello", "pid": int, "confinement": {<every Confinement field, as plain values>}}``, once, at start;
- ``{"kind": "error", "index": int, "text": str}``, an item that scored 0 by an error (``text`` at most
  ``MAX_TEXT_CHARS``, control characters replaced);
- ``{"kind": "done"}``, the batch is scored.

Anything else (a frame over ``MAX_MESSAGE_BYTES``, bytes that are not JSON, an unknown kind, a missing, extra or
mistyped field) raises ``MalformedMessage``. The trainer's side (``TrainerEnd``) reads only what the socket already
holds and sends with a deadline, so a worker that stops halfway through a frame, or stops reading, cannot stall it.
Trainer to worker the payload is a pickled batch: the trainer is trusted, and records carry metadata of any Python
type (tuples, numpy scalars) that JSON would silently change.

Scores do not go through the socket but through shared memory: for item ``i`` of the batch the worker writes
``scores[i]`` and ``status[i]`` (``SCORED`` or ``FAILED``; the trainer resets it to ``UNSCORED`` before each batch),
then sets ``progress`` to ``i + 1``; the trainer checks every value it reads there (``finite_unit``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import pickle
import socket
import struct
import time
from typing import Any

from stare_lightning.rewards.confinement import Confinement

__all__ = [
    "FAILED",
    "SCORED",
    "UNSCORED",
    "MalformedMessage",
    "TrainerEnd",
    "decode",
    "done",
    "error",
    "finite_unit",
    "hello",
    "receive_batch",
    "send_message",
]

MAX_MESSAGE_BYTES = 64 * 1024
MAX_TEXT_CHARS = 400
MAX_PATHS, MAX_PATH_CHARS = 64, 4096  # Confinement.unreadable_paths
MAX_PID = 1 << 22  # the kernel's pid_max ceiling
_HEADER = struct.Struct("!Q")
UNSCORED, SCORED, FAILED = 0, 1, 2  # the values of status[i] in shared memory


class MalformedMessage(ValueError):
    """The worker sent something outside the fixed schema (the worker is to be treated as compromised)."""


# -- the worker's side ----------------------------------------------------------------------------------------------
def _frame(payload: bytes) -> bytes:
    return _HEADER.pack(len(payload)) + payload


def _json(message: dict) -> bytes:
    return json.dumps(message, allow_nan=False, ensure_ascii=True, separators=(",", ":")).encode()


def _printable(text: str) -> str:
    text = text[:MAX_TEXT_CHARS]
    return "".join(c if c.isprintable() else "?" for c in text)


def hello(pid: int, confinement: Confinement) -> bytes:
    fields = dataclasses.asdict(confinement)
    fields["unreadable_paths"] = [p[:MAX_PATH_CHARS] for p in fields["unreadable_paths"][:MAX_PATHS]]
    return _json({"kind": "hello", "pid": pid, "confinement": fields})


def error(index: int, text: str) -> bytes:
    return _json({"kind": "error", "index": index, "text": _printable(text)})


def done() -> bytes:
    return _json({"kind": "done"})


def send_message(sock: socket.socket, payload: bytes) -> None:
    sock.sendall(_frame(payload))


def _receive_exactly(sock: socket.socket, size: int) -> bytes | None:
    buffer = bytearray(size)
    view, got = memoryview(buffer), 0
    while got < size:
        n = sock.recv_into(view[got:])
        if n == 0:
            return None
        got += n
    return bytes(buffer)


def receive_batch(sock: socket.socket) -> Any:
    """The next batch the trainer sent (blocking), or None once the trainer closed its end."""
    header = _receive_exactly(sock, _HEADER.size)
    if header is None:
        return None
    payload = _receive_exactly(sock, _HEADER.unpack(header)[0])
    return None if payload is None else pickle.loads(payload)


# -- the trainer's side ---------------------------------------------------------------------------------------------
def _integer(value: Any, low: int, high: int, what: str) -> int:
    if type(value) is not int or not low <= value <= high:
        raise MalformedMessage(f"{what} must be an int in [{low}, {high}], got {_shown(value)}")
    return value


def _text(value: Any, limit: int, what: str) -> str:
    if type(value) is not str or len(value) > limit:
        raise MalformedMessage(f"{what} must be a string of at most {limit} characters, got {_shown(value)}")
    return value


def _shown(value: Any) -> str:
    return f"{type(value).__name__} {repr(value)[:60]}"


def _field(name: str, annotation: str, value: Any) -> Any:
    what = f"hello's confinement.{name}"
    if annotation == "bool":
        if type(value) is not bool:
            raise MalformedMessage(f"{what} must be true or false, got {_shown(value)}")
        return value
    if annotation == "int":
        return _integer(value, 0, (1 << 32) - 1, what)
    if annotation == "int | None":
        return None if value is None else _integer(value, 0, 1 << 40, what)
    if annotation == "str":
        return _text(value, MAX_TEXT_CHARS, what)
    if annotation == "tuple[str, ...]":
        if type(value) is not list or len(value) > MAX_PATHS:
            raise MalformedMessage(f"{what} must be a list of at most {MAX_PATHS} strings, got {_shown(value)}")
        return tuple(_text(item, MAX_PATH_CHARS, f"{what}[]") for item in value)
    raise TypeError(f"the worker protocol has no check for Confinement.{name} of type {annotation!r}: add one")


def _confinement(value: Any) -> Confinement:
    fields = {f.name: str(f.type) for f in dataclasses.fields(Confinement)}
    if type(value) is not dict or set(value) != set(fields):
        keys = sorted(value) if type(value) is dict else _shown(value)
        raise MalformedMessage(f"hello's confinement must have exactly the fields {sorted(fields)}, got {keys}")
    return Confinement(**{name: _field(name, annotation, value[name]) for name, annotation in fields.items()})


_SHAPES = {"hello": {"kind", "pid", "confinement"}, "error": {"kind", "index", "text"}, "done": {"kind"}}


def _no_constants(name: str) -> float:
    raise ValueError(f"{name} is not allowed")


def decode(payload: bytes, expected: frozenset[str] | set[str], items: int = 0) -> dict:
    """One worker message, checked against its schema; ``expected`` lists the kinds allowed at this point and
    ``items`` bounds an error's index. Raises MalformedMessage."""
    try:
        message = json.loads(payload.decode("utf-8"), parse_constant=_no_constants)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise MalformedMessage(f"not a JSON message ({type(exc).__name__}: {str(exc)[:80]})") from None
    if type(message) is not dict or message.get("kind") not in _SHAPES:
        raise MalformedMessage(f"not a message of a known kind ({sorted(_SHAPES)}): {_shown(message)}")
    kind = message["kind"]
    if set(message) != _SHAPES[kind]:
        raise MalformedMessage(
            f"a {kind!r} message has exactly the fields {sorted(_SHAPES[kind])}, got {sorted(message)}"
        )
    if kind not in expected:
        raise MalformedMessage(f"a {kind!r} message where only {sorted(expected)} may come")
    if kind == "hello":
        return {
            "kind": kind,
            "pid": _integer(message["pid"], 1, MAX_PID, "hello's pid"),
            "confinement": _confinement(message["confinement"]),
        }
    if kind == "error":
        index = _integer(message["index"], 0, max(items - 1, 0), "an error's index")
        return {
            "kind": kind,
            "index": index,
            "text": _printable(_text(message["text"], MAX_TEXT_CHARS, "an error's text")),
        }
    return {"kind": kind}


class TrainerEnd:
    """The trainer's end of the worker's socket: frames out with a deadline, frames in without ever blocking."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._buffer = bytearray()

    def send(self, payload: Any, deadline: float) -> bool:
        """Pickle and send ``payload``; False when the worker did not take it all by ``deadline`` (or is gone)."""
        view = memoryview(_frame(pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)))
        while view:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            self._sock.settimeout(remaining)
            try:
                sent = self._sock.send(view)
            except (TimeoutError, OSError):
                return False
            view = view[sent:]
        return True

    def receive(self, timeout: float) -> list[bytes]:
        """The payloads of the frames complete within ``timeout`` (waiting only while none has arrived).

        Raises EOFError once the worker's end is closed and every whole frame before that was returned, and
        MalformedMessage for a frame longer than ``MAX_MESSAGE_BYTES`` (its payload is never read)."""
        frames = self._complete_frames()
        if frames:
            return frames
        self._sock.settimeout(max(timeout, 0.0))  # 0: look without waiting (poll's timer would round up to 1 ms)
        try:
            chunk = self._sock.recv(MAX_MESSAGE_BYTES + _HEADER.size)
        except (TimeoutError, BlockingIOError):
            return []
        except OSError as exc:
            raise EOFError(f"the worker's socket failed: {exc}") from None
        if not chunk:
            if self._buffer:
                raise MalformedMessage(
                    f"the worker closed its end in the middle of a frame ({len(self._buffer)} bytes)"
                )
            raise EOFError("the worker closed its end")
        self._buffer += chunk
        return self._complete_frames()

    def _complete_frames(self) -> list[bytes]:
        frames = []
        while len(self._buffer) >= _HEADER.size:
            size = _HEADER.unpack_from(self._buffer)[0]
            if size > MAX_MESSAGE_BYTES:
                raise MalformedMessage(f"a message of {size} bytes (at most {MAX_MESSAGE_BYTES})")
            end = _HEADER.size + size
            if len(self._buffer) < end:
                break
            frames.append(bytes(self._buffer[_HEADER.size : end]))
            del self._buffer[:end]
        return frames

    @property
    def partial(self) -> bool:
        """Bytes of an unfinished frame are waiting (a worker stopped now was in the middle of one)."""
        return bool(self._buffer)

    def close(self) -> None:
        self._sock.close()


def finite_unit(value: float) -> bool:
    """A score the shared memory may hold: a finite float in [0, 1]."""
    return math.isfinite(value) and 0.0 <= value <= 1.0
