"""Where a training step's rollouts come from, and how the engine hears of the update that follows.

``InStepRollouts``: collected inside the step from the colocated engine, whose weights are synced after the
optimizer steps (the synchronous step). ``AsyncRollouts`` (``rollout=server``): taken from a ``RolloutProducer``
started at the fit's first step, which collects the data module's training batches ahead of the trainer with the
synchronous step's prompts and seeds, at most ``rollout.max_staleness`` versions behind; after the optimizer steps
the trainer publishes the new version for it. Both hand the step a ``StepRollouts``, so the step reads the same
either way.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from stare_lightning import distributed
from stare_lightning.metrics.telemetry import async_metrics
from stare_lightning.rollout.backends import declared_backend
from stare_lightning.rollout.base import RolloutEngine
from stare_lightning.rollout.config import RolloutConfig
from stare_lightning.seeds import derived_seed
from stare_lightning.step.collect import Collection, CollectionStats
from stare_lightning.step.producer import RolloutProducer, Taken
from stare_lightning.step.runner import StepRunner

if TYPE_CHECKING:
    from stare_lightning.rollout.factory import SyncedEngine

__all__ = [
    "AsyncRollouts",
    "EngineAccess",
    "InStepRollouts",
    "PromptBatches",
    "RolloutSource",
    "StepRollouts",
    "rollout_source",
]


class PromptBatches(Protocol):
    """What a rollout source reads of the fit's prompts (``data.datamodule.PromptDataModule``)."""

    batches_consumed: int  # the training batches the dataloader has handed over

    def train_batch(self, index: int) -> list[dict]:
        """The prompts of training batch ``index``."""
        ...

    def more_prompts(self, count: int, *, step: int, attempt: int) -> list[dict]:
        """``count`` prompts for a further generation batch (dynamic sampling) of optimizer step ``step``."""
        ...


@dataclass(frozen=True)
class EngineAccess:
    """How a rollout source reaches the run's engine. ``synced``: the run's ``SyncedEngine`` (put to sleep after a
    collection, marked stale after the optimizer steps); ``engine()``: its engine, synced (built on first use);
    ``sampler(engine)``: what samples from an engine (tool episodes on top of it with a tool)."""

    synced: SyncedEngine
    engine: Callable[[], RolloutEngine]
    sampler: Callable[[RolloutEngine], RolloutEngine]


@dataclass(frozen=True)
class StepRollouts:
    """A step's collection, and (from the producer) how it was taken."""

    collection: Collection
    taken: Taken | None = None

    @property
    def staleness(self) -> int:
        return self.taken.staleness if self.taken is not None else 0

    @property
    def phase(self) -> str:
        """What the step timer calls the time spent getting it: collecting, or waiting for the producer."""
        return "collect" if self.taken is None else "trainer_idle"

    def metrics(self) -> dict[str, float]:
        """``train/async/*`` and the producer's times (``metrics.telemetry.async_metrics``), when it came from one."""
        return async_metrics(self.taken) if self.taken is not None else {}

    def step_stats(self) -> CollectionStats:
        """The collection's counters as the step's costs see them: a producer's seconds were not the step's."""
        stats = self.collection.stats
        return stats if self.taken is None else stats.off_the_step()


class RolloutSource(Protocol):
    """Where the training step gets its rollouts; ``rollout_source`` picks the one the run's backend calls for."""

    def take(self, batch: list[dict], *, step: int, seed: int, policy: torch.nn.Module) -> StepRollouts:
        """The rollouts of the data module's ``batch`` of prompts at optimizer step ``step`` with the step's
        ``seed``; ``policy``: the trainer's current policy."""
        ...

    def publish(self, rollouts: StepRollouts, policy: torch.nn.Module) -> None:
        """After the step's optimizer steps, on every rank: the engine gets (or will get) the new weights."""
        ...

    def drain(self) -> None:
        """Before validation: nothing is generated ahead with older weights than the trainer's."""
        ...

    def close(self) -> None: ...


def rollout_source(
    rollout: RolloutConfig,
    runner: StepRunner,
    data: PromptBatches,
    engines: EngineAccess,
    *,
    seed: int,
    max_steps: int,
) -> RolloutSource:
    """The source of a run's rollouts: ``AsyncRollouts`` with ``rollout=server``, else ``InStepRollouts``. ``data``:
    the fit's prompts; ``engines``: how the run's engine is reached; ``seed``: the run's (a step's is
    ``derived_seed(seed, step)``, as the synchronous step's); ``max_steps``: the fit's optimizer steps (-1:
    unbounded). A served backend's rollouts come from a producer beside the trainer (``rollout.max_staleness``
    versions behind at most), a colocated one's from the step itself."""
    backend = declared_backend(rollout.backend)
    if backend is None or not backend.served:
        return InStepRollouts(runner, data, engines)
    engines.engine()  # a served backend is reached now: a server that does not answer stops the run before step 1
    return AsyncRollouts(
        runner,
        data,
        engines,
        max_staleness=rollout.max_staleness,
        steps_per_batch=runner.plan.ppo_epochs * runner.plan.mini_batches,
        seed=seed,
        max_steps=max_steps,
    )


class InStepRollouts:
    """The synchronous step's rollouts (``rollout_source`` says what the arguments are)."""

    def __init__(self, runner: StepRunner, data: PromptBatches, engines: EngineAccess) -> None:
        self.runner, self.data, self.engines = runner, data, engines

    def take(self, batch: list[dict], *, step: int, seed: int, policy: torch.nn.Module) -> StepRollouts:
        """The step's rollouts, collected now from the synced engine (``policy`` is what it holds already)."""

        def more_prompts(count: int, attempt: int) -> list[dict]:
            return self.data.more_prompts(count, step=step, attempt=attempt)

        sampler = self.engines.sampler(self.engines.engine())
        collection = self.runner.collect(batch, sampler, seed=seed, more_prompts=more_prompts)
        self.engines.synced.sleep()  # with rollout.enable_sleep_mode: the update gets the engine's GPU memory
        return StepRollouts(collection)

    def publish(self, rollouts: StepRollouts, policy: torch.nn.Module) -> None:
        self.engines.synced.mark_stale()
        self.engines.engine()  # the weight sync, right after the optimizer steps, on every rank

    def drain(self) -> None:
        pass

    def close(self) -> None:
        pass


class AsyncRollouts:
    """``rollout=server``'s rollouts (``rollout_source`` says what the arguments are); ``steps_per_batch``: optimizer
    steps per rollout batch (``ppo_epochs x mini_batches``)."""

    def __init__(
        self,
        runner: StepRunner,
        data: PromptBatches,
        engines: EngineAccess,
        *,
        max_staleness: int,
        steps_per_batch: int,
        seed: int,
        max_steps: int,
    ) -> None:
        self.runner, self.data, self.engines = runner, data, engines
        self.max_staleness, self.steps_per_batch, self.seed = max_staleness, steps_per_batch, seed
        self.max_steps = max_steps
        self.producer: RolloutProducer | None = None

    def take(self, batch: list[dict], *, step: int, seed: int, policy: torch.nn.Module) -> StepRollouts:
        """The batch the dataloader just handed over (``batch``, its prompts), at optimizer step ``step``;
        ``policy``: the weights the producer starts from; ``seed`` is the synchronous step's, which the producer
        derives itself for the batches it collects ahead (``derived_seed`` of the run's seed and the step)."""
        index = self.data.batches_consumed - 1
        if self.producer is None:
            engine = self.engines.engine()
            left = -(-(self.max_steps - step) // self.steps_per_batch) if self.max_steps >= 0 else 2**62
            self.producer = RolloutProducer(
                lambda b: self._collect(b, engine),
                engine,
                max_staleness=self.max_staleness,
                first=index,
                last=index + max(left, 1),
                # The producer's collectives get a group of their own: the trainer's run on the default one meanwhile.
                group=distributed.new_side_group(),
                servers_hold=index,  # the synced engine holds the weights the fit starts from
            )
            self.producer.publish(index, policy, label=f"the policy at step {step}")
        taken = self.producer.take(index)
        ids = [item["id"] for item in batch]
        if taken.produced.prompt_ids != ids:
            raise RuntimeError(
                f"the rollout producer's batch {index} holds prompts {taken.produced.prompt_ids[:4]}..., the "
                f"trainer's {ids[:4]}...: the data module's batches and its position disagree"
            )
        return StepRollouts(taken.produced.collection, taken)

    def publish(self, rollouts: StepRollouts, policy: torch.nn.Module) -> None:
        """After the step's optimizer steps (every rank): the next version, for the producer to push when needed."""
        version = rollouts.taken.produced.batch + 1
        self.producer.publish(version, policy, label=f"the policy after step {version * self.steps_per_batch}")

    def drain(self) -> None:
        """Before validation: the servers get the trainer's current weights while the producer waits."""
        if self.producer is not None:
            self.producer.drain()

    def close(self) -> None:
        if self.producer is not None:
            self.producer.close()

    def _collect(self, index: int, engine: RolloutEngine) -> tuple[Collection, list]:
        """The producer's work for batch ``index`` (in its thread): the step's prompts, collected with the seeds the
        synchronous step would use (those of the optimizer step the batch starts at, none skipped)."""
        prompts, step = self.data.train_batch(index), index * self.steps_per_batch
        collection = self.runner.collect(
            prompts,
            self.engines.sampler(engine),
            seed=derived_seed(self.seed, step),
            more_prompts=lambda count, attempt: self.data.more_prompts(count, step=step, attempt=attempt),
        )
        return collection, [item["id"] for item in prompts]
