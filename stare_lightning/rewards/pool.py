"""Score responses in a persistent worker process, every call under a hard per-call deadline.

``VerifierPool.score`` ships a whole batch of ``(verifier_name, response, answer, metadata)`` items to
one long-lived worker (``multiprocessing``, spawn context by default) in a single message; the worker
scores item by item, and the parent gives each item ``timeout_s`` seconds from the end of the previous one.
An item that misses its deadline (``9^{9^{9^{9}}}`` handed to sympy, a user verifier that loops) scores 0
and is counted; the worker is killed (SIGKILL: a C-level big-integer power ignores signals and
exceptions) and a fresh one picks up the rest of the batch. An exception, a score that is not a number
in [0, 1], or a crashed worker scores 0 and counts as an error. Nothing the verifiers do can stop the
training loop, and no verifier ever runs in the trainer process.

Verifiers read model output, and the parsers they use may evaluate it, so the worker is untrusted: it starts
with an empty environment, then confines itself before importing any verifier (``confinement.py``: no network,
nothing writable, a uid of its own, memory and process limits), and every call runs under ``scoring_guard``
(text is evaluated only when it names nothing but sympy constructors and harmless builtins; no process, socket or
file write). A call that trips the guard scores 0 and counts as an error.

Progress and scores travel through shared memory (one counter, two arrays); the pipe carries one
message each way per batch (plus one per error), so the cost over calling the verifiers in-process is
one round trip plus pickling the batch (measured here: about 0.3 ms for 128 countdown checks, on top
of the 3.4 ms the checks themselves take). There is no in-process fast path: at that price the
guarantee is kept for every verifier.

The worker imports only ``stare_lightning.rewards`` and the verifiers it is asked for, never the
caller's main script (see ``_main_module_hidden``), so user verifiers must live in importable modules.
It is a daemon process: a user verifier may not start processes of its own. It ignores
SIGINT (the trainer decides when it stops), exits when its pipe closes, and is killed by ``close()``,
when the pool is garbage-collected, and at interpreter exit.
"""

from __future__ import annotations

import contextlib
import logging
import math
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
import types
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from stare_lightning.rewards import scoring_guard
from stare_lightning.rewards.confinement import Confinement, confine, worker_environment

log = logging.getLogger(__name__)

Item = tuple  # (verifier_name: str, response: str, answer: str, metadata: dict)

_MAX_MESSAGES = 20
_DEAD = object()


@dataclass
class ScoreResult:
    """Scores in input order; ``timeouts`` and ``errors`` count the items that scored 0 for those reasons."""

    scores: list[float]
    timeouts: int = 0
    errors: int = 0
    messages: list[str] = field(default_factory=list)  # the first few timeouts / errors, for logs


def _as_score(value: Any) -> float:
    try:
        score = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"verifier returned {type(value).__name__} {value!r}, not a number") from None
    if not (math.isfinite(score) and 0.0 <= score <= 1.0):
        raise ValueError(f"verifier returned {score!r}, outside [0, 1]")
    return score


_OK, _ERROR = 1, 2


def _worker_main(conn, progress, scores, status, memory_limit_mb: int | None) -> None:
    """Worker loop: receive a batch, resolve its verifiers, score it; errors are reported as they happen.

    Progress goes through shared memory, not the pipe: ``scores[i]`` and ``status[i]`` are written, then
    ``progress`` is set to ``i + 1``, so the parent can time every item and keep the finished ones when
    it has to kill the worker. ``progress`` is -1 while the batch's verifiers are being imported.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    confinement = confine(memory_limit_mb)
    from stare_lightning.rewards.registry import get_verifier

    scoring_guard.install()
    functions: dict[str, Any] = {}
    broken: dict[str, str] = {}
    conn.send(("hello", os.getpid(), confinement))
    while True:
        try:
            batch = conn.recv()
        except (EOFError, OSError):
            return
        if batch is None:
            return
        for name in dict.fromkeys(item[0] for item in batch):
            if name in functions or name in broken:
                continue
            try:
                fn = get_verifier(name)
            except BaseException as exc:  # noqa: BLE001 - report anything, keep serving
                broken[name] = f"cannot load verifier: {type(exc).__name__}: {exc}"[:400]
                continue
            warmup = getattr(fn, "warmup", None)
            if callable(warmup):
                try:
                    warmup()
                except BaseException:  # noqa: BLE001 - the calls themselves will report errors
                    pass
            functions[name] = fn
        progress.value = 0
        for i, (name, response, answer, metadata) in enumerate(batch):
            if name in broken:
                scores[i], status[i] = 0.0, _ERROR
                conn.send(("error", i, broken[name]))
            else:
                try:
                    prepare = getattr(functions[name], "prepare", None)
                    if callable(prepare):
                        prepare(response, answer, metadata)
                    with scoring_guard.guarded() as refusals:
                        score = _as_score(functions[name](response, answer, metadata))
                    if refusals:  # a scorer swallowed the ScoringViolation: the item still scores 0
                        raise scoring_guard.ScoringViolation(f"refused while scoring: {refusals[0]}")
                    scores[i], status[i] = score, _OK
                except BaseException as exc:  # noqa: BLE001 - a verifier may raise anything, even SystemExit
                    scores[i], status[i] = 0.0, _ERROR
                    conn.send(("error", i, f"{type(exc).__name__}: {exc}"[:400]))
            progress.value = i + 1
        conn.send(("done", None))


@contextlib.contextmanager
def _environment_replaced(environment: dict[str, str]):
    """Spawn the worker with ``environment`` only: the child is started with this process's environment, and a
    secret that reached the worker's memory could be read back from ``/proc/self/environ`` whatever the worker
    clears later. Swapped for the duration of ``Process.start`` (milliseconds), under the pool's lock."""
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(environment)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


@contextlib.contextmanager
def _main_module_hidden():
    """Start the worker without re-running the caller's ``__main__``.

    A spawned child normally imports the parent's main script (as ``__mp_main__``) so that functions
    defined there can be unpickled; the worker needs nothing from it, and a training script without an
    ``if __name__ == "__main__":`` guard would be run a second time inside the worker. ``multiprocessing``
    computes what to import while ``Process.start`` runs, so a bare stand-in module is put in place just
    for that call. (Consequence: user verifiers must live in an importable module, not in ``__main__``.)
    """
    real = sys.modules.get("__main__")
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        if real is not None:
            sys.modules["__main__"] = real


class _Worker:
    """The live worker process and its pipe; shared with the finalizer so it always sees the current one."""

    def __init__(self) -> None:
        self.proc = None
        self.conn = None


def _stop(worker: _Worker) -> None:
    conn, proc = worker.conn, worker.proc
    worker.conn = worker.proc = None
    if conn is not None:
        try:
            conn.close()
        except OSError:
            pass
    if proc is not None:
        if proc.is_alive():
            proc.kill()
        proc.join(timeout=10)


class VerifierPool:
    """Runs verifiers in a persistent worker process with a hard timeout per call.

    Args:
        timeout_s: seconds each item may take, counted from the end of the previous item.
        start_method: ``"spawn"`` (default) or ``"forkserver"``; ``"fork"`` is refused (unsafe in a
            process that runs torch threads).
        startup_timeout_s: seconds allowed to start the worker and to import the verifiers a batch
            needs (math-verify pulls in sympy); not charged to any item.
        memory_limit_mb: address-space limit of the worker (``RLIMIT_AS``; None for none); a verifier that
            exceeds it raises MemoryError, which counts as an error.
    """

    max_items_per_message = 4096

    def __init__(
        self,
        timeout_s: float = 5.0,
        *,
        start_method: str = "spawn",
        startup_timeout_s: float = 120.0,
        memory_limit_mb: int | None = 4096,
    ) -> None:
        if not (isinstance(timeout_s, (int, float)) and math.isfinite(timeout_s) and timeout_s > 0):
            raise ValueError(f"VerifierPool timeout_s must be a positive number of seconds, got {timeout_s!r}")
        if not (isinstance(startup_timeout_s, (int, float)) and startup_timeout_s > 0):
            raise ValueError(f"VerifierPool startup_timeout_s must be positive, got {startup_timeout_s!r}")
        allowed = [m for m in ("spawn", "forkserver") if m in mp.get_all_start_methods()]
        if start_method not in allowed:
            raise ValueError(f"VerifierPool start_method must be one of {allowed}, got {start_method!r}")
        if memory_limit_mb is not None and (type(memory_limit_mb) is not int or memory_limit_mb <= 0):
            raise ValueError(f"VerifierPool memory_limit_mb must be a positive int or None, got {memory_limit_mb!r}")
        self.timeout_s = float(timeout_s)
        self.startup_timeout_s = float(startup_timeout_s)
        self.memory_limit_mb = memory_limit_mb
        self.start_method = start_method
        self.starts = 0  # worker processes started so far (1 + restarts after timeouts / crashes)
        self._ctx = mp.get_context(start_method)
        cap = self.max_items_per_message
        self._progress = self._ctx.RawValue("q", 0)
        self._scores = self._ctx.RawArray("d", cap)
        self._status = self._ctx.RawArray("b", cap)
        self._slice = min(0.1, self.timeout_s / 10)
        self._worker = _Worker()
        self._lock = threading.Lock()
        self._closed = False
        self._finalizer = weakref.finalize(self, _stop, self._worker)
        self.confinement: Confinement | None = None  # what the worker runs under, once one has started
        self._warned = False

    # -- worker lifecycle -------------------------------------------------------------------------
    def _ensure_worker(self) -> None:
        if self._worker.proc is not None and self._worker.proc.is_alive():
            return
        _stop(self._worker)
        parent_conn, child_conn = self._ctx.Pipe(duplex=True)
        proc = self._ctx.Process(
            target=_worker_main,
            args=(child_conn, self._progress, self._scores, self._status, self.memory_limit_mb),
            daemon=True,
            name="stare-verifier",
        )
        with _main_module_hidden(), _environment_replaced(worker_environment()):
            proc.start()
        child_conn.close()
        self._worker.proc, self._worker.conn = proc, parent_conn
        self.starts += 1
        try:
            hello = parent_conn.recv() if parent_conn.poll(self.startup_timeout_s) else None
        except (EOFError, OSError):
            hello = None
        ok = hello is not None and hello[0] == "hello"
        if ok:
            self.confinement = hello[2]
            if not self._warned and self.confinement.weaknesses():
                self._warned = True
                log.warning("the verifier worker %s", "; ".join(self.confinement.weaknesses()))
        if not ok:
            proc.join(timeout=0.5)
            code = proc.exitcode
            _stop(self._worker)
            raise RuntimeError(
                f"the verifier worker process died while starting (exit code {code})"
                if code is not None
                else f"the verifier worker process did not start within {self.startup_timeout_s:g} s"
            )

    def restart(self) -> None:
        """Kill the worker; the next ``score`` starts a fresh one."""
        with self._lock:
            _stop(self._worker)

    @property
    def worker_pid(self) -> int | None:
        """Process id of the live worker, or None."""
        proc = self._worker.proc
        return proc.pid if proc is not None and proc.is_alive() else None

    # -- scoring ----------------------------------------------------------------------------------
    def score(self, items: Iterable[Item]) -> ScoreResult:
        """Score ``(verifier_name, response, answer, metadata)`` items; never hangs past the deadlines."""
        items = [tuple(item) for item in items]
        for i, item in enumerate(items):
            if len(item) != 4 or not isinstance(item[0], str) or not isinstance(item[1], str):
                raise TypeError(
                    f"VerifierPool.score item {i} must be (verifier_name: str, response: str, answer, metadata: dict)"
                )
        result = ScoreResult(scores=[0.0] * len(items))
        with self._lock:
            if self._closed:
                raise RuntimeError("VerifierPool.score called after close()")
            try:
                pos = 0
                while pos < len(items):
                    end = min(len(items), pos + self.max_items_per_message)
                    pos = self._run_chunk(items, pos, end, result)
            except BaseException:
                _stop(self._worker)  # never leave a worker busy with a batch nobody waits for
                raise
        return result

    def _note(self, result: ScoreResult, text: str) -> None:
        if len(result.messages) < _MAX_MESSAGES:
            result.messages.append(text)

    def _collect(self, items: list, pos: int, count: int, result: ScoreResult, errors: dict) -> None:
        """Copy ``count`` finished scores of the chunk starting at ``pos`` out of shared memory."""
        scores, status = self._scores[:count], self._status[:count]
        for k in range(count):
            if status[k] == _OK:
                result.scores[pos + k] = scores[k]
            else:
                result.errors += 1
                detail = errors.get(k, "error (details lost with the worker)")
                self._note(result, f"item {pos + k} ({items[pos + k][0]}): {detail}")

    def _run_chunk(self, items: list, pos: int, end: int, result: ScoreResult) -> int:
        """Score ``items[pos:end]``; return the index to continue from (``end`` unless the worker was killed)."""
        self._ensure_worker()
        conn = self._worker.conn
        self._progress.value = -1
        conn.send(items[pos:end])
        seen, since = -1, time.monotonic()
        errors: dict[int, str] = {}
        while True:
            try:
                reply = conn.recv() if conn.poll(self._slice) else None
            except (EOFError, OSError):
                reply = _DEAD
            if reply is not None and reply is not _DEAD:
                if reply[0] == "error":
                    errors[reply[1]] = reply[2]
                    continue
                self._collect(items, pos, end - pos, result, errors)
                return end
            done = self._progress.value
            now = time.monotonic()
            if done != seen:
                seen, since = done, now
            if reply is None and now - since <= (self.startup_timeout_s if done < 0 else self.timeout_s):
                continue
            # The worker is stuck on item `done` (or died on it): keep what finished, kill it, move on.
            _stop(self._worker)
            if done < 0:
                result.errors += end - pos
                self._note(result, f"items {pos}..{end - 1}: the worker could not load their verifiers in time")
                return end
            self._collect(items, pos, done, result, errors)
            index = pos + done
            if index >= end:  # died after the last item, before reporting: nothing is lost
                return end
            if reply is _DEAD:
                result.errors += 1
                self._note(result, f"item {index} ({items[index][0]}): the worker process died")
            else:
                result.timeouts += 1
                self._note(result, f"item {index} ({items[index][0]}): no answer within {self.timeout_s:g} s")
            return index + 1

    # -- shutdown ---------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the worker. Further ``score`` calls raise."""
        with self._lock:
            self._closed = True
            self._finalizer()

    def __enter__(self) -> VerifierPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
