"""The asynchronous producer's schedule (step/producer.py), with a real thread: batch ``b`` always comes from version
``max(first, b - K)``, never before that version is published, each version is pushed once as it was when
published, ``drain`` leaves the servers on the newest version, and a failure reaches the trainer.

The servers are replaced by an engine that records what it was sent; ``tests/test_fit_server.py`` runs the producer
against real vLLM servers. Over two gloo ranks, with dynamic sampling's global filter in the producer's thread, a
rank left with no group of its own still trains on every batch and joins every collective."""

from __future__ import annotations

import time
import weakref

import pytest
import torch

from stare_lightning.step.producer import RolloutProducer
from tests.test_step_collect import ALL_RIGHT, ALL_WRONG, MIXED, N, ScriptedEngine, _item


class RecordingEngine:
    """What the producer needs of a ``ServerRolloutEngine``: gathered host copies and pushes, recorded."""

    def __init__(self) -> None:
        self.pushes: list[tuple[str, list]] = []
        self.version: str | None = None

    def gather_weights(self, model, policy=None):
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


class HostCopy(list):
    """A host copy of the weights that a weak reference can follow (a plain list cannot), counted by identity."""

    __hash__ = object.__hash__
    __eq__ = object.__eq__


class CountingEngine(RecordingEngine):
    """Counts the host copies alive (rank 0's memory); its pushes keep none, as a server's push does not."""

    def __init__(self) -> None:
        super().__init__()
        self.alive: weakref.WeakSet = weakref.WeakSet()

    def gather_weights(self, model, policy=None):
        copy = HostCopy(super().gather_weights(model))
        self.alive.add(copy)
        return copy

    def push(self, weights, version=None):
        self.pushes.append((version, None))
        self.version = version
        return version

    def count(self) -> int:
        return len(self.alive)  # a copy is freed when its last reference goes (no cycles hold one): no gc needed


@pytest.mark.parametrize("max_staleness", [0, 1, 2, 4])
def test_rank_0_holds_at_most_k_plus_1_host_copies(max_staleness):
    """Counted as the trainer publishes and as the producer collects, up to a producer that waits at the planned end
    while the trainer publishes its last versions (there every published version used to stay: K + 2 at K = 2)."""
    last, counts = 10, []
    engine = CountingEngine()

    def collect(batch):
        counts.append(engine.count())
        return f"collection {batch}", [batch]

    producer = RolloutProducer(collect, engine, max_staleness=max_staleness, first=0, last=last)
    model = torch.nn.Linear(2, 1, bias=False)
    producer.publish(0, model)
    waited_at_the_end = False
    for b in range(last):
        producer.take(b)
        time.sleep(0.01)  # the update: the producer runs ahead as far as its bound lets it
        waited_at_the_end |= producer._next == last
        model.weight.data.fill_(float(b + 1))
        producer.publish(b + 1, model)
        counts.append(engine.count())
    producer.close()
    assert waited_at_the_end or max_staleness == 0  # the control: the case that used to keep every version
    assert max(counts) <= max_staleness + 1, counts
    assert max(counts) == max_staleness + 1  # the bound is reached: the count is measured, not always small
    assert [name for name, _ in engine.pushes] == [f"v{v}" for v in range(0, last - max_staleness)]


# Two ranks, two prompts each per batch; dynamic sampling over one generation batch (no refill). Batch 0: rank 1's
# own groups all agree (filtered out), yet the global filter keeps a and b and deals one to each rank. Batch 1: only
# g survives, so rank 1 is dealt nothing. Batch 2: nothing survives anywhere.
FILTERED_SCRIPT = {
    (0, "a"): MIXED, (0, "b"): MIXED, (0, "c"): ALL_WRONG, (0, "d"): ALL_WRONG,
    (1, "e"): ALL_RIGHT, (1, "f"): ALL_RIGHT, (1, "g"): MIXED, (1, "h"): ALL_WRONG,
    (2, "i"): ALL_WRONG, (2, "j"): ALL_RIGHT, (2, "k"): ALL_WRONG, (2, "l"): ALL_WRONG,
}  # fmt: skip
FILTERED_PROMPTS = ["abcd", "efgh", "ijkl"]


class ScriptedServers(ScriptedEngine, RecordingEngine):
    """The scripted engine, standing in for the servers: it records pushes as ``RecordingEngine`` does."""

    def __init__(self, script: dict[tuple[int, str], list[str]]) -> None:
        ScriptedEngine.__init__(self, script)
        RecordingEngine.__init__(self)


def produce_with_a_rank_filtered_out(rank: int, world: int) -> list[tuple[int, list[str], float, float]]:
    """The producer (K = 1, its collectives on a side group) and a trainer loop whose update is a collective on the
    default group; per batch: its version, this rank's kept prompt ids, its advantages' largest magnitude and the
    rows every rank trained on between them."""
    from stare_lightning import distributed
    from stare_lightning.algorithms import AlgorithmConfig
    from stare_lightning.rewards import VerifierPool
    from stare_lightning.rollout.base import SamplingParams
    from stare_lightning.step.collect import collect

    cfg = AlgorithmConfig(collection={"dynamic_sampling": True, "max_generation_batches": 1})
    model = torch.nn.Linear(2, 1, bias=False)
    engine = ScriptedServers(FILTERED_SCRIPT)
    with VerifierPool() as pool:

        def collect_batch(b):
            prompts = FILTERED_PROMPTS[b][rank * 2 : rank * 2 + 2]
            params = SamplingParams(n=N, max_new_tokens=8)
            got = collect([_item(x) for x in prompts], engine, pool, params, cfg.collection, cfg.advantage,
                          pad_token_id=0, seed=b)  # fmt: skip
            return got, list(prompts)

        producer = RolloutProducer(
            collect_batch, engine, max_staleness=1, first=0, last=3, group=distributed.new_side_group()
        )
        producer.publish(0, model)
        seen = []
        for b in range(3):
            got = producer.take(b).produced
            batch = got.collection.batch
            rows = distributed.all_reduce(torch.tensor(float(batch.num_rows)))  # the update's collectives
            seen.append((got.version, [item["id"] for item in got.collection.items],
                         batch.advantages.abs().max().item(), rows.item()))  # fmt: skip
            model.weight.data.add_(1.0)
            producer.publish(b + 1, model)
        producer.close()
    return seen


@pytest.mark.slow
def test_a_rank_whose_groups_were_all_filtered_out_joins_every_collective(tmp_path):
    """Asynchronous collection over two gloo ranks: whatever dynamic sampling leaves a rank, the rank trains on every
    batch (on a dealt share, on a stand-in of its own rows when the other rank was dealt every kept group, or on its
    own last groups at zero advantage when no group survived) and both ranks take every step."""
    from tests.distributed import run_on_ranks

    ranks = run_on_ranks(produce_with_a_rank_filtered_out, tmp_path)
    versions = [[v for v, *_ in ranks[r]] for r in (0, 1)]
    assert versions == [[0, 0, 1]] * 2  # batch b from version max(0, b - 1) on both ranks
    kept = [[ids for _, ids, *_ in ranks[r]] for r in (0, 1)]
    # Batch 0: a and b dealt one each (rank 1's own c and d were filtered out); batch 1: g to rank 0, and rank 1
    # runs on a stand-in (its own rows, no group); batch 2: nothing survived, each rank its own groups at zero
    # advantage.
    assert kept == [[["a"], ["g"], ["i", "j"]], [["b"], [], ["k", "l"]]]
    signal = [[peak > 0 for _, _, peak, _ in ranks[r]] for r in (0, 1)]
    assert signal == [[True, True, False], [True, False, False]]
    assert [rows for *_, rows in ranks[0]] == [2 * N, 3 * N, 4 * N] == [rows for *_, rows in ranks[1]]
