"""The scoring pass from logits the same-batch telemetry already holds equals the scoring pass's own forward."""

from __future__ import annotations

import dataclasses

import torch

from stare_lightning.step.scoring import response_logits, score_batch, scores_from_logits
from tests.test_official_semantics import TEMPERATURE, fixed_batch


def test_scores_from_held_logits_equal_a_fresh_scoring_pass(tiny_dir):
    from transformers import AutoModelForCausalLM

    policy = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    batch = fixed_batch(policy.config.vocab_size)
    kwargs = dict(temperature=TEMPERATURE, chunk_size=5, micro_batch_tokens=40)
    fresh = score_batch(policy, batch, **kwargs)
    held = scores_from_logits(response_logits(policy, batch, micro_batch_tokens=40), batch, **kwargs)
    for field in dataclasses.fields(fresh):
        assert torch.equal(getattr(fresh, field.name), getattr(held, field.name)), field.name
