"""Asynchronous collection with bounded staleness (``rollout.max_staleness=K``, ``rollout=server``).

A thread beside the trainer collects the training steps' batches in order, batch ``b`` by policy version
``max(first, b - K)``, where version ``v`` is the policy after the trainer's first ``v`` batches (``first``: the batch
this fit starts at). The trainer publishes version ``v`` once batch ``v - 1``'s optimizer steps are done: every rank
gathers the full weights (a collective) and rank 0 keeps a host copy; before collecting batch ``b`` the producer
pushes the copy of its version to the servers unless they hold it already. So:

- no optimizer step trains on a sample older than K versions, and batch ``b`` is generated while the trainer works
  on batches ``b - K .. b - 1``;
- a sample's version is fixed by its batch, never by timing, and its seed is the step's (``collect`` seeds by
  generation batch and record id): an asynchronous run samples the same tokens every time it runs;
- nothing is generated to be thrown away: batch ``b`` is admitted only once its version exists, which keeps the
  producer at most K + 1 batches ahead of the trainer (the K + 1 copies of the weights this takes live on rank 0's
  host memory);
- pushes happen between batches only, so no request is in flight when the weights change (vLLM's pause mode
  ``wait``) and every response of a batch comes from one version;
- K = 0 runs the synchronous step through the same machinery: batch ``b`` waits for version ``b``.

With several ranks each rank's producer collects its own share, and dynamic sampling's exchanges run on the
producer's own process group (``distributed.collectives_on``); rank 0 pushes while the other ranks wait for it at
a collective of that group. A run resumed from a checkpoint at batch ``g`` publishes version ``g`` first, so its
first K batches come from the checkpoint's weights, as at the start of a run; samples generated but not trained
on when a run stopped are not kept, and are generated again.

Where this departs from fully asynchronous trainers (AReaL, PipelineRL): they push mid-generation and let a
response span versions, which keeps the servers busier but makes each sample's versions depend on timing.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from stare_lightning import distributed
from stare_lightning.step.collect import Collection

__all__ = ["Produced", "RolloutProducer"]


@dataclass(frozen=True)
class Produced:
    """One batch the producer collected, with how it came about."""

    batch: int  # the training batch (step) it is for
    version: int  # the policy version that generated every one of its samples
    collection: Collection
    prompt_ids: list  # the record ids of the step's own prompts (before dynamic sampling drew more)
    engine_idle_seconds: float  # the producer's wait for this batch's version to be published
    push_seconds: float  # the push of that version to the servers (0 when they held it)


@dataclass(frozen=True)
class Taken:
    """``RolloutProducer.take``'s answer: the batch and what the trainer saw of the queue."""

    produced: Produced
    waited_seconds: float  # the trainer's wait for it (trainer idle)
    queue_depth: int  # batches ready when the trainer asked, this one included

    @property
    def staleness(self) -> int:
        return self.produced.batch - self.produced.version


class RolloutProducer:
    """Collects batch ``b`` (``collect_batch(b) -> (collection, prompt ids)``) with version ``max(first, b - K)``.

    ``engine``: the ``ServerRolloutEngine`` the collections sample from (``gather_weights``, ``push``);
    ``first``: the batch this fit starts at; ``last``: the batch it is expected to end before (the producer
    collects no further unless the trainer asks for one, e.g. after a skipped optimizer step); ``group``: the process
    group of the producer's collectives (None on one process); ``servers_hold``: the version the servers hold
    already, if any (it is not pushed again). Call ``publish(first)`` before the first ``take``.
    """

    def __init__(
        self,
        collect_batch: Callable[[int], tuple[Collection, list]],
        engine,
        *,
        max_staleness: int,
        first: int,
        last: int | None = None,
        group=None,
        servers_hold: int | None = None,
    ) -> None:
        if max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
        self.collect_batch, self.engine, self.max_staleness = collect_batch, engine, max_staleness
        self.first, self.last, self.group = first, last if last is not None else 2**62, group
        self._lock = threading.Condition()
        self._copies: dict[int, list | None] = {}  # published versions not yet pushed (rank 0's host copies)
        self._published = first - 1
        self._on_servers = servers_hold
        self._next = first  # the batch the producer collects next
        self._ready: dict[int, Produced] = {}
        self._waiting = False  # the producer waits for its next batch to be wanted or its version published
        self._error: BaseException | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="rollout-producer", daemon=True)

    def version_of(self, batch: int) -> int:
        return max(self.first, batch - self.max_staleness)

    # -- the trainer's side ------------------------------------------------------------------------------------
    def publish(self, version: int, model: torch.nn.Module, label: str | None = None) -> float:
        """Version ``version`` of the policy is ``model``'s weights now: gather them (every rank) for the producer.
        Returns the seconds the gather took. ``label`` names these weights in an error (a weight holding NaN or
        inf is refused here, before it can be pushed)."""
        started = time.perf_counter()
        copy = self.engine.gather_weights(model, policy=label or f"policy version {version}")
        with self._lock:
            self._raise_error()  # a producer that failed reports it at the trainer's first chance
            if version != self._published + 1:
                raise RuntimeError(f"version {version} published after version {self._published}")
            self._copies[version] = copy
            self._published = version
            self._drop_unneeded_copies()
            self._lock.notify_all()
        if self._thread.ident is None and not self._closed:  # started by the first version, once
            self._thread.start()
        return time.perf_counter() - started

    def take(self, batch: int) -> Taken:
        """Batch ``batch``'s collection, waiting for the producer if it is not ready."""
        if self.version_of(batch) > self._published:
            raise RuntimeError(f"batch {batch} needs version {self.version_of(batch)}; {self._published} is published")
        started = time.perf_counter()
        with self._lock:
            if batch >= self.last:
                self.last = batch + 1
                self._lock.notify_all()
            while batch not in self._ready and self._error is None:
                self._lock.wait()
            self._raise_error()
            depth = len(self._ready)
            produced = self._ready.pop(batch)
        return Taken(produced, time.perf_counter() - started, depth)

    def drain(self) -> None:
        """Wait until the producer has collected every batch whose version is published, then make the servers hold
        the newest published version (every rank: validation samples the trainer's current weights)."""
        with self._lock:
            if self._published < self.first:  # nothing published: the producer has not started
                return
            while not self._idle() and self._error is None:
                self._lock.wait()
            self._raise_error()
            behind = self._on_servers != self._published
            copy = self._copies.get(self._published)
        if behind:  # the producer is idle: the main thread may push
            self._push(self._published, copy)
            if distributed.is_distributed():
                distributed.all_reduce(torch.zeros(1))

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._lock.notify_all()

    # -- the producer's side -----------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            with distributed.collectives_on(self.group):
                while True:
                    version, idle, copy = self._await_turn()
                    if version is None:
                        return
                    push = 0.0
                    if self._on_servers != version:
                        started = time.perf_counter()
                        self._push(version, copy)
                        if distributed.is_distributed():  # no rank samples before rank 0's push is done
                            distributed.all_reduce(torch.zeros(1))
                        push = time.perf_counter() - started
                    # The servers hold this version now: a reference kept here would hold a copy of the weights the
                    # whole batch long, beyond the K + 1 the trainer may publish meanwhile.
                    copy = None
                    collection, prompt_ids = self.collect_batch(self._next)
                    with self._lock:
                        self._ready[self._next] = Produced(self._next, version, collection, prompt_ids, idle, push)
                        self._next += 1
                        self._lock.notify_all()
        except BaseException as error:  # the trainer re-raises it at its next take or drain
            with self._lock:
                self._error = error
                self._lock.notify_all()

    def _await_turn(self) -> tuple[int | None, float, list | None]:
        """Wait until the next batch is wanted and its version published; its version, the wait and the version's
        host copy (None off rank 0), or None when closed."""
        started = time.perf_counter()
        with self._lock:
            self._waiting = True
            self._lock.notify_all()
            while not self._closed and (self._next >= self.last or self._published < self.version_of(self._next)):
                self._lock.wait()
            self._waiting = False
            if self._closed:
                return None, 0.0, None
            version = self.version_of(self._next)
            self._drop_unneeded_copies()
            copy = self._copies.get(version)
        return version, time.perf_counter() - started, copy

    def _drop_unneeded_copies(self) -> None:
        """Forget the host copies no batch can need any more (call under the lock): those older than the next batch's
        version. The producer is never behind the trainer's newest version by more than K (it collects batch ``b``
        before the trainer publishes ``b + 1``), so at most K + 1 copies are left, the newest included (``drain``
        pushes it). Pruned when the trainer publishes too: a producer waiting at the planned end would otherwise
        keep every version published meanwhile."""
        for old in [v for v in self._copies if v < self.version_of(self._next)]:
            del self._copies[old]

    def _idle(self) -> bool:
        """The producer has collected every batch it may collect now (call under the lock)."""
        return self._waiting and (self._next >= self.last or self.version_of(self._next) > self._published)

    def _push(self, version: int, copy: list | None) -> None:
        name = f"v{version}"
        if copy is not None:  # rank 0
            self.engine.push(copy, version=name)
        else:
            self.engine.expect_version(name)
        self._on_servers = version

    def _raise_error(self) -> None:
        if self._error is not None:
            raise self._error
