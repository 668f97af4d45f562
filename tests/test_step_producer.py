"""The asynchronous producer's schedule (step/producer.py), with a real thread: batch ``b`` always comes from version
``max(first, b - K)``, never before that version is published, each version is pushed once as it was when
published, ``drain`` leaves the servers on the newest version, and a failure reaches the trainer.

The servers are replaced by an engine that records what it was sent; ``tests/test_fit_server.py`` runs the producer
against real vLLM servers."""

from __future__ import annotations

import time

import pytest
import torch

from stare_lightning.step.producer import RolloutProducer


class RecordingEngine:
    """What the producer needs of a ``ServerRolloutEngine``: gathered host copies and pushes, recorded."""

    def __init__(self) -> None:
        self.pushes: list[tuple[str, list]] = []
        self.version: str | None = None

    def gather_weights(self, model):
        return [(name, p.detach().clone()) for name, p in model.named_parameters()]

    def push(self, weights, version=None):
        self.pushes.append((version, weights))
        self.version = version
        return version

    def expect_version(self, version):
        self.version = version


class Trainer:
    """A trainer loop: take batch ``b``, change the weights (the optimizer step), publish version ``b + 1``."""

    def __init__(self, max_staleness: int, first: int = 0, last: int | None = None, collect=None) -> None:
        self.model = torch.nn.Linear(2, 1, bias=False)
        torch.nn.init.zeros_(self.model.weight)
        self.engine = RecordingEngine()
        self.published = first - 1
        self.collected: list[tuple[int, int, str | None]] = []  # (batch, newest published version, engine version)
        self.producer = RolloutProducer(
            collect or self.collect, self.engine, max_staleness=max_staleness, first=first, last=last
        )

    def collect(self, batch: int):
        self.collected.append((batch, self.published, self.engine.version))
        time.sleep(0.002)  # a little generation time, so trainer and producer interleave
        return f"collection {batch}", [batch]

    def publish(self, version: int) -> None:
        self.model.weight.data.fill_(float(version))
        self.published = version
        self.producer.publish(version, self.model)

    def run(self, batches: range):
        self.publish(batches.start)
        taken = []
        for b in batches:
            taken.append(self.producer.take(b))
            self.publish(b + 1)
        self.producer.close()
        return taken


@pytest.mark.parametrize("max_staleness", [0, 1, 2, 4])
@pytest.mark.parametrize("first", [0, 5])
def test_each_batch_comes_from_its_version_and_never_earlier(max_staleness, first):
    trainer = Trainer(max_staleness, first=first, last=first + 12)
    taken = trainer.run(range(first, first + 12))
    for b, t in zip(range(first, first + 12), taken):
        assert t.produced.batch == b and t.produced.collection == f"collection {b}"
        assert t.produced.version == max(first, b - max_staleness)
        assert t.staleness == min(b - first, max_staleness)
    for b, newest, engine_version in trainer.collected:
        version = max(first, b - max_staleness)
        assert newest >= version  # admitted only once its version was published
        assert newest <= b  # and never collected ahead of the trainer by more than K + 1 batches...
        assert engine_version == f"v{version}"  # ...by the servers holding exactly that version
    # Every version a batch needed was pushed once, in order, with the weights it had when it was published.
    versions = sorted({max(first, b - max_staleness) for b in range(first, first + 12)})
    assert [name for name, _ in trainer.engine.pushes] == [f"v{v}" for v in versions]
    for (_, weights), v in zip(trainer.engine.pushes, versions):
        assert torch.equal(weights[0][1], torch.full((1, 2), float(v)))


def test_the_producer_runs_ahead_while_the_trainer_works():
    """With K = 2 the producer holds batches b + 1 and b + 2 while the trainer is still on b."""
    trainer = Trainer(2, last=6)
    trainer.publish(0)
    first = trainer.producer.take(0)
    deadline = time.monotonic() + 30
    while len(trainer.collected) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [b for b, *_ in trainer.collected] == [0, 1, 2]  # batches 1 and 2 need version 0 only
    time.sleep(0.1)
    assert len(trainer.collected) == 3  # batch 3 waits for version 1
    assert first.staleness == 0
    trainer.publish(1)
    second = trainer.producer.take(1)
    assert second.queue_depth == 2  # batch 2 was ready too
    trainer.producer.close()


def test_drain_leaves_the_servers_on_the_newest_version_with_nothing_in_flight():
    trainer = Trainer(2, last=8)
    trainer.publish(0)
    for b in range(3):
        trainer.producer.take(b)
        trainer.publish(b + 1)
        trainer.producer.drain()  # what validation does between two steps
        assert trainer.engine.version == f"v{b + 1}"
        assert all(batch <= b + 1 + 2 for batch, *_ in trainer.collected)
    trainer.producer.close()


def test_drain_after_the_last_batch_pushes_the_final_weights():
    trainer = Trainer(2, last=4)
    trainer.run(range(0, 4))
    trainer.producer.drain()
    assert trainer.engine.version == "v4"
    assert torch.equal(trainer.engine.pushes[-1][1][0][1], torch.full((1, 2), 4.0))


def test_a_batch_past_the_planned_end_is_still_collected():
    """A skipped optimizer step leaves the fit one batch short of ``max_steps``: the producer goes on for it."""
    trainer = Trainer(1, last=2)
    taken = trainer.run(range(0, 4))
    assert [t.produced.batch for t in taken] == [0, 1, 2, 3]


def test_a_failure_in_the_producer_reaches_the_trainer():
    def collect(batch):
        if batch == 2:
            raise ConnectionError("rollout server http://127.0.0.1:1 stopped answering")
        return f"collection {batch}", [batch]

    trainer = Trainer(1, last=5, collect=collect)
    trainer.publish(0)
    trainer.producer.take(0)
    trainer.publish(1)
    trainer.producer.take(1)
    # Batch 2 needs version 1 only, so it may already have failed when version 2 is published: the error is
    # raised at whichever of the two calls comes after the failure.
    with pytest.raises(ConnectionError, match="stopped answering"):
        trainer.publish(2)
        trainer.producer.take(2)
    with pytest.raises(ConnectionError):
        trainer.producer.drain()
    with pytest.raises(ConnectionError):  # the trainer's next publication hears of it too, the thread stays down
        trainer.publish(3)


def test_a_batch_whose_version_is_not_published_is_refused():
    trainer = Trainer(0, last=3)
    trainer.publish(0)
    with pytest.raises(RuntimeError, match="batch 1 needs version 1"):
        trainer.producer.take(1)
    trainer.producer.close()


def test_close_stops_a_waiting_producer():
    trainer = Trainer(0, last=3)
    trainer.publish(0)
    trainer.producer.take(0)
    trainer.producer.close()
    trainer.producer._thread.join(timeout=10)
    assert not trainer.producer._thread.is_alive()


def test_the_version_the_servers_start_with_is_not_pushed_again():
    trainer = Trainer(1, first=3, last=6)
    trainer.producer = RolloutProducer(
        trainer.collect, trainer.engine, max_staleness=1, first=3, last=6, servers_hold=3
    )
    trainer.run(range(3, 6))
    assert [name for name, _ in trainer.engine.pushes] == ["v4"]  # batches 3 and 4 come from version 3
