"""The verifier worker process: it confines itself, then scores each batch the trainer sends, item by item, guarded.

``main`` is what ``VerifierPool`` starts (a module-level function: a spawned child finds it by importing this
module). It ignores SIGINT (the trainer decides when it stops), confines the process before any verifier is imported
(``confinement.confine``; with a pid namespace only the namespace's pid 1 comes back from it, the process the pool
started staying outside as its supervisor), installs ``scoring_guard`` and says hello. Then, for every batch: import
the verifiers it names (once each; one that cannot be imported fails its items), score each item under the guard,
write ``scores[i]`` and ``status[i]`` to shared memory before setting ``progress`` to ``i + 1``, and send an error
message for each item that failed and ``done`` at the end (``worker_protocol``). It returns when the trainer closes
its end of the socket.
"""

from __future__ import annotations

import math
import os
import signal
import socket
from collections.abc import Iterable
from typing import Any

from stare_lightning.rewards import scoring_guard, worker_protocol
from stare_lightning.rewards.confinement import confine
from stare_lightning.rewards.registry import get_verifier
from stare_lightning.rewards.worker_protocol import FAILED, SCORED

__all__ = ["main"]


def main(sock: socket.socket, progress, scores, status, memory_limit_mb: int | None) -> None:
    """The worker's whole life: confine, say hello, score batches until the trainer closes the socket."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    confinement = confine(memory_limit_mb)  # with a pid namespace, returns in the namespace's pid 1 only
    scoring_guard.install()
    worker_protocol.send_message(sock, worker_protocol.hello(os.getpid(), confinement))
    _Scorer(sock, progress, scores, status).serve()


def _as_score(value: Any) -> float:
    try:
        score = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"verifier returned {type(value).__name__} {value!r}, not a number") from None
    if not (math.isfinite(score) and 0.0 <= score <= 1.0):
        raise ValueError(f"verifier returned {score!r}, outside [0, 1]")
    return score


def _score_item(verifier: Any, response: str, answer: Any, metadata: Any) -> float:
    """One verifier call: ``prepare`` outside the guard (trusted code building what the call needs), the call in it."""
    prepare = getattr(verifier, "prepare", None)
    if callable(prepare):
        prepare(response, answer, metadata)
    with scoring_guard.guarded() as refusals:
        score = _as_score(verifier(response, answer, metadata))
    if refusals:  # a scorer swallowed the ScoringViolation: the item still scores 0
        raise scoring_guard.ScoringViolation(f"refused while scoring: {refusals[0]}")
    return score


class _Scorer:
    """The worker's state between batches: its socket, the shared memory it reports in, the verifiers it imported."""

    def __init__(self, sock: socket.socket, progress, scores, status) -> None:
        self.sock = sock
        self.progress, self.scores, self.status = progress, scores, status
        self.verifiers: dict[str, Any] = {}
        self.broken: dict[str, str] = {}  # verifier name -> why it cannot be imported

    def serve(self) -> None:
        while True:
            try:
                batch = worker_protocol.receive_batch(self.sock)
            except OSError:
                return
            if batch is None:
                return
            self._load(dict.fromkeys(item[0] for item in batch))
            self._score_batch(batch)

    def _load(self, names: Iterable[str]) -> None:
        """Import the verifiers not seen before; ``warmup`` each (its failures show in the calls themselves)."""
        for name in names:
            if name in self.verifiers or name in self.broken:
                continue
            try:
                verifier = get_verifier(name)
            except BaseException as exc:  # noqa: BLE001 - report anything, keep serving
                self.broken[name] = f"cannot load verifier: {type(exc).__name__}: {exc}"
                continue
            warmup = getattr(verifier, "warmup", None)
            if callable(warmup):
                try:
                    warmup()
                except BaseException:  # noqa: BLE001 - the calls themselves will report errors
                    pass
            self.verifiers[name] = verifier

    def _score_batch(self, batch: list) -> None:
        self.progress.value = 0
        for i, (name, response, answer, metadata) in enumerate(batch):
            if name in self.broken:
                self._fail(i, self.broken[name])
            else:
                try:
                    score = _score_item(self.verifiers[name], response, answer, metadata)
                    self.scores[i], self.status[i] = score, SCORED
                except BaseException as exc:  # noqa: BLE001 - a verifier may raise anything, even SystemExit
                    self._fail(i, f"{type(exc).__name__}: {exc}")
            self.progress.value = i + 1
        worker_protocol.send_message(self.sock, worker_protocol.done())

    def _fail(self, index: int, text: str) -> None:
        self.scores[index], self.status[index] = 0.0, FAILED
        worker_protocol.send_message(self.sock, worker_protocol.error(index, text))
