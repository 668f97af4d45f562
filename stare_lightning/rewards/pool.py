"""Score responses in a persistent worker process, every call under a hard per-item deadline and a per-call budget.

``VerifierPool.score`` ships a whole batch of ``(verifier_name, response, answer, metadata)`` items to
one long-lived worker (``multiprocessing``, spawn context by default) in a single message; the worker
scores item by item, and the parent gives each item ``timeout_s`` seconds from the end of the previous one,
and the whole call ``batch_timeout_s``. An item that misses its deadline (``9^{9^{9^{9}}}`` handed to sympy, a
user verifier that loops) scores 0 and is counted; the worker is killed (SIGKILL: a C-level big-integer power
ignores signals and exceptions) and a fresh one picks up the rest of the batch. Once the call's budget is spent,
the worker is killed and every item not yet scored scores 0 as a timeout. An exception, a score that is not a
number in [0, 1], or a crashed worker scores 0 and counts as an error. Nothing the verifiers do can stop the
training loop, and no verifier ever runs in the trainer process.

Verifiers read model output, and the parsers they use may evaluate it, so the worker is untrusted: it starts
with an empty environment, then confines itself before importing any verifier (``confinement.py``: no network,
nothing writable, a uid and a pid namespace of its own, memory and process limits), and every call runs under
``scoring_guard`` (text is evaluated only when it names nothing but listed sympy constructors and harmless
builtins; no process, socket or file write). A call that trips the guard scores 0 and counts as an error.

What the worker sends back is data, never objects (``worker_protocol``): length-prefixed JSON of three fixed
shapes, read without blocking, and scores in shared memory (one counter, two arrays), each value checked (a
finite score in [0, 1], a known status, a progress within the batch). A worker that breaks that contract is
running someone's code: it is killed, and the items it affected score 0 as errors. "Affected" means every item of
the batch message in flight up to the one it was on when caught (its shared-memory scores could have been
written by that code); items after it go to a fresh worker, and items of earlier messages, collected before,
keep their scores. The cost over calling the verifiers in-process is one round trip plus pickling the batch
(``benchmarks/bench_verifier_pool.py`` prints it). There is no in-process fast path: at that price the guarantee
is kept for every verifier.

The worker's side is ``worker.py``; one batch message, watched from here, is ``message_watch.py``. The worker
imports only ``stare_lightning.rewards`` and the verifiers it is asked for, never the caller's main script (see
``_main_module_hidden``), so user verifiers must live in importable modules.
It is a daemon process: a user verifier may not start processes of its own. It ignores
SIGINT (the trainer decides when it stops), exits when its socket closes, and is stopped by ``close()``,
when the pool is garbage-collected, and at interpreter exit (SIGTERM to the process the pool started, which
kills and reaps the worker; SIGKILL if it has not exited within ``_STOP_GRACE_S``).
"""

from __future__ import annotations

import contextlib
import logging
import math
import multiprocessing as mp
import os
import socket
import sys
import threading
import time
import types
import weakref
from collections.abc import Iterable

from stare_lightning.rewards import worker, worker_protocol
from stare_lightning.rewards.confinement import Confinement, worker_environment
from stare_lightning.rewards.message_watch import Compromised, Message, MessageWatch, ScoreResult, SharedScores
from stare_lightning.rewards.worker_protocol import MalformedMessage, TrainerEnd

log = logging.getLogger(__name__)

Item = tuple  # (verifier_name: str, response: str, answer: str, metadata: dict)

_STOP_GRACE_S = 2.0  # the supervisor kills and reaps the worker on SIGTERM within milliseconds
# Default budget of one score() call: honest items take milliseconds (math-verify: ~3 ms median, ~0.2 s at worst on
# a cold cache; countdown: ~30 us), so 50 ms each is ten times the usual cost, and the fixed 60 s pays for a worker
# start with its sympy import (2-5 s) plus about ten items that run into the default 5 s per-item limit.
BATCH_BUDGET_BASE_S, BATCH_BUDGET_PER_ITEM_S = 60.0, 0.05


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
    """The live worker process and the trainer's end of its socket; shared with the finalizer."""

    def __init__(self) -> None:
        self.proc = None
        self.end: TrainerEnd | None = None

    def stop(self) -> None:
        """SIGTERM to the process the pool started (the pid namespace's supervisor kills and reaps the worker, and
        the namespace dies with it), SIGKILL if it lingers."""
        end, proc = self.end, self.proc
        self.end = self.proc = None
        if end is not None:
            end.close()
        if proc is not None:
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=_STOP_GRACE_S)
            if proc.is_alive():
                proc.kill()
            proc.join(timeout=10)


class VerifierPool:
    """Runs verifiers in a persistent worker process with a hard timeout per item and a time budget per call.

    Args:
        timeout_s: seconds each item may take, counted from the end of the previous item.
        batch_timeout_s: seconds one ``score`` call may take in all (worker starts and imports included); items
            not scored by then score 0 as timeouts. None (the default): ``BATCH_BUDGET_BASE_S`` plus
            ``BATCH_BUDGET_PER_ITEM_S`` per item.
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
        batch_timeout_s: float | None = None,
        start_method: str = "spawn",
        startup_timeout_s: float = 120.0,
        memory_limit_mb: int | None = 4096,
    ) -> None:
        if not (isinstance(timeout_s, (int, float)) and math.isfinite(timeout_s) and timeout_s > 0):
            raise ValueError(f"VerifierPool timeout_s must be a positive number of seconds, got {timeout_s!r}")
        if batch_timeout_s is not None and not (
            isinstance(batch_timeout_s, (int, float)) and math.isfinite(batch_timeout_s) and batch_timeout_s > 0
        ):
            raise ValueError(
                f"VerifierPool batch_timeout_s must be a positive number of seconds or None, got {batch_timeout_s!r}"
            )
        if not (isinstance(startup_timeout_s, (int, float)) and startup_timeout_s > 0):
            raise ValueError(f"VerifierPool startup_timeout_s must be positive, got {startup_timeout_s!r}")
        allowed = [m for m in ("spawn", "forkserver") if m in mp.get_all_start_methods()]
        if start_method not in allowed:
            raise ValueError(f"VerifierPool start_method must be one of {allowed}, got {start_method!r}")
        if memory_limit_mb is not None and (type(memory_limit_mb) is not int or memory_limit_mb <= 0):
            raise ValueError(f"VerifierPool memory_limit_mb must be a positive int or None, got {memory_limit_mb!r}")
        self.timeout_s = float(timeout_s)
        self.batch_timeout_s = None if batch_timeout_s is None else float(batch_timeout_s)
        self.startup_timeout_s = float(startup_timeout_s)
        self.memory_limit_mb = memory_limit_mb
        self.start_method = start_method
        self.starts = 0  # worker processes started so far (1 + restarts after timeouts / crashes)
        self._ctx = mp.get_context(start_method)
        self._shared = SharedScores(self._ctx, self.max_items_per_message)
        self._slice = min(0.1, self.timeout_s / 10)
        self._worker = _Worker()
        self._watch = MessageWatch(self._shared, self._worker.stop, self.timeout_s, self.startup_timeout_s, self._slice)
        self._lock = threading.Lock()
        self._closed = False
        self._finalizer = weakref.finalize(self, self._worker.stop)
        self.confinement: Confinement | None = None  # what the worker runs under, once one has started
        self._warned = False

    def budget_s(self, items: int) -> float:
        """The time budget of a ``score`` call with ``items`` items."""
        if self.batch_timeout_s is not None:
            return self.batch_timeout_s
        return BATCH_BUDGET_BASE_S + BATCH_BUDGET_PER_ITEM_S * items

    # -- worker lifecycle -------------------------------------------------------------------------
    def _ensure_worker(self, deadline: float) -> bool:
        """A live worker that has said hello; False when the call's budget ran out first (the worker is stopped).

        Raises RuntimeError when the worker dies while starting, does not start within ``startup_timeout_s``
        or starts with a malformed hello."""
        if self._worker.proc is not None and self._worker.proc.is_alive():
            return True
        self._worker.stop()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        proc = self._ctx.Process(
            target=worker.main,
            args=(theirs, self._shared.progress, self._shared.scores, self._shared.status, self.memory_limit_mb),
            daemon=True,
            name="stare-verifier",
        )
        with _main_module_hidden(), _environment_replaced(worker_environment()):
            proc.start()
        theirs.close()
        end = TrainerEnd(ours)
        self._worker.proc, self._worker.end = proc, end
        self.starts += 1
        started = time.monotonic()
        hello, problem = self._await_hello(end, min(started + self.startup_timeout_s, deadline))
        if hello is not None:
            self.confinement = hello["confinement"]
            if not self._warned and self.confinement.weaknesses():
                self._warned = True
                log.warning("the verifier worker %s", "; ".join(self.confinement.weaknesses()))
            return True
        proc.join(timeout=0.5)
        code = proc.exitcode
        self._worker.stop()
        if problem is None and time.monotonic() >= deadline and deadline < started + self.startup_timeout_s:
            return False  # the call's budget, not the start-up limit, ran out
        if problem is not None and problem != "died":
            raise RuntimeError(f"the verifier worker process {problem}")
        raise RuntimeError(
            f"the verifier worker process died while starting (exit code {code})"
            if code is not None
            else f"the verifier worker process did not start within {self.startup_timeout_s:g} s"
        )

    def _await_hello(self, end: TrainerEnd, limit: float) -> tuple[dict | None, str | None]:
        """The new worker's hello, or what went wrong instead ("died", a malformed hello); neither by ``limit``."""
        while time.monotonic() < limit:
            try:
                frames = end.receive(min(self._slice, max(0.0, limit - time.monotonic())))
                if len(frames) > 1:
                    raise MalformedMessage("a message after hello before any batch")
                if frames:
                    return worker_protocol.decode(frames[0], {"hello"}), None
            except EOFError:
                return None, "died"
            except MalformedMessage as exc:
                return None, f"sent a malformed hello ({exc})"
        return None, None

    def restart(self) -> None:
        """Kill the worker; the next ``score`` starts a fresh one."""
        with self._lock:
            self._worker.stop()

    @property
    def worker_pid(self) -> int | None:
        """Process id (in the trainer's view) of the live worker's process, or None. With a pid namespace this is
        the namespace's supervisor; the worker itself is its only child."""
        proc = self._worker.proc
        return proc.pid if proc is not None and proc.is_alive() else None

    # -- scoring ----------------------------------------------------------------------------------
    def score(self, items: Iterable[Item]) -> ScoreResult:
        """Score ``(verifier_name, response, answer, metadata)`` items; never runs past the call's budget."""
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
            budget = self.budget_s(len(items))
            deadline = time.monotonic() + budget
            try:
                pos = 0
                while pos < len(items):
                    if time.monotonic() >= deadline:
                        self._worker.stop()
                        result.timeouts += len(items) - pos
                        result.note(f"items {pos}..{len(items) - 1}: past the call's budget of {budget:g} s")
                        break
                    end = min(len(items), pos + self.max_items_per_message)
                    pos = self._run_chunk(items, pos, end, result, deadline)
            except BaseException:
                self._worker.stop()  # never leave a worker busy with a batch nobody waits for
                raise
        return result

    def _run_chunk(self, items: list, pos: int, end: int, result: ScoreResult, deadline: float) -> int:
        """Score ``items[pos:end]``; return the index to continue from (``end`` unless the worker was stopped)."""
        count = end - pos
        try:
            return self._score_message(Message(items, pos, end, result, deadline))
        except Compromised as exc:
            self._worker.stop()
            done = self._shared.progress.value  # -1 (still importing verifiers) or nonsense: none of it is trusted
            last = min(pos + done, end - 1) if 0 <= done <= count else end - 1
            for k in range(pos, last + 1):
                result.scores[k] = 0.0
            result.errors += last + 1 - pos
            result.note(
                f"items {pos}..{last}: the worker broke the message protocol ({exc}); it was killed and what it "
                "scored in this message discarded"
            )
            return last + 1

    def _spoke_out_of_turn(self) -> bool:
        """Whether the idle worker sent anything since its last batch (or died): if so it is stopped, and no item
        is affected (the next one starts fresh)."""
        try:
            spoke = bool(self._worker.end.receive(0.0))
        except (EOFError, MalformedMessage):
            spoke = True
        if spoke:
            log.warning("the verifier worker sent data between batches or died idle: stopped, a fresh one starts")
            self._worker.stop()
        return spoke

    def _score_message(self, message: Message) -> int:
        """Score one message in a live worker that has kept quiet since its last batch."""
        self._shared.reset(message.count)
        deadline = message.deadline
        if not self._ensure_worker(deadline) or (self._spoke_out_of_turn() and not self._ensure_worker(deadline)):
            return message.pos  # out of budget: the caller scores the rest as timeouts
        return self._watch.run(self._worker.end, message)

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
