"""A rollout backend: Hugging Face generation with the trainer's policy, each call's size and time in the run's log.

A backend is a builder, ``(rollout, context) -> engine``, and an entry that says what the engine supports. This one
wraps the built-in HF engine; a backend of your own would build its own engine (the protocol is
``stare_lightning.rollout.base.RolloutEngine``) and declare what it can do in the same way.
"""

from __future__ import annotations

import logging
import time

from stare_lightning.rollout.backends import RolloutBackend, register_rollout_backend
from stare_lightning.rollout.hf import build_hf_engine

logger = logging.getLogger(__name__)


class LoggedEngine:
    """Another engine, with one log line per ``generate`` call; the rest of the protocol is the wrapped engine's."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.holds_weight_copy = engine.holds_weight_copy  # HF: False, it samples from the trained module itself

    def generate(self, prompt_ids, params, seeds=None, max_new_tokens=None):
        started = time.perf_counter()
        rollouts = self.engine.generate(prompt_ids, params, seeds, max_new_tokens)
        logger.info(
            "logged_hf: %d prompts, %d samples, %d tokens in %.2f s",
            len(prompt_ids), len(rollouts.response_ids), rollouts.num_tokens, time.perf_counter() - started,
        )  # fmt: skip
        return rollouts

    def sync_weights(self, model) -> None:
        self.engine.sync_weights(model)

    def sleep(self) -> None:
        self.engine.sleep()

    def wake(self) -> None:
        self.engine.wake()

    def close(self) -> None:
        self.engine.close()


def build_logged_hf(rollout, context) -> LoggedEngine:
    """The builder: ``rollout`` is the run's ``rollout`` settings, ``context`` the policy, tokenizer, model
    directory, seed and compute dtype (``stare_lightning.rollout.backends.EngineContext``)."""
    return LoggedEngine(build_hf_engine(rollout, context))


register_rollout_backend(
    RolloutBackend(
        name="logged_hf",
        builder="my_project.rollout:build_logged_hf",
        summary="HF generate, each call logged",
        holds_weight_copy=False,  # like the HF engine it wraps: no weights of its own to sync or offload
    )
)
