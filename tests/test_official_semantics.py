"""``algorithm=stare_o1_official`` against a loop re-implementation of the reference trainer's procedure.

The reference below is written from the method (docs/method.md) and the reference trainer's documented
behaviour, not from this project's functions: per micro-batch one forward of the policy; old log-probs are
that forward's detached log-probs (on-policy, ratio exactly 1); STARE's gate compares the step batch's entropy,
aggregated like the loss, with its target; L+ is the ceil(P x |T+|) highest-surprisal tokens among the
micro-batch's positive-advantage tokens; the dual-clip surrogate is multiplied by omega and aggregated within
the micro-batch (token-mean: its own token mean; seq-mean-token-mean: the mean of its rows' token means), then
scaled by the micro-batch's share of the mini-batch's sequences (verl 0.7's data-parallel actor with dynamic
micro-batch sizes); gradients accumulate over micro-batches. The project's loss on the same fixed batch, model
and micro-batch partition must give the same weights, losses and gradients.
"""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from stare_lightning.algorithms import AlgorithmConfig
from stare_lightning.step import Experience, LossPlan, micro_batch_loss, micro_batches
from stare_lightning.step.normalizer import step_normalizer
from stare_lightning.step.scoring import score_batch
from stare_lightning.step.selection import TokenSelection, gate_entropy
from tests.experiences import on_policy_experience
from tests.test_algorithms_config import CONF_DIR

TEMPERATURE, W, MAX_NEW_TOKENS = 0.9, 3.0, 12


def official_config(**changes) -> AlgorithmConfig:
    with initialize_config_dir(config_dir=str(CONF_DIR.parent), version_base="1.3"):
        composed = compose("algorithm/stare_o1_official").algorithm
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(AlgorithmConfig), composed))
    changes["stare"] = {"w": W, **changes.get("stare", {})}
    return dataclasses.replace(
        cfg, **{group: dataclasses.replace(getattr(cfg, group), **v) for group, v in changes.items()}
    )


def fixed_batch(vocab: int) -> Experience:
    """Eight rows of different prompt and response lengths, advantages of both signs and one zero."""
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (3, 5, 4, 6, 3, 5, 4, 6)]
    responses = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (7, 2, 9, 4, 12, 5, 3, 8)]
    advantages = torch.tensor([0.8, -0.8, 0.5, -1.2, 1.0, -0.3, 0.0, 0.7])
    return on_policy_experience(prompts, responses, advantages, n=4)


# ------------------------------------------------------------------------------------- the reference loop


def reference_logprobs_and_entropy(model, part) -> tuple[torch.Tensor, torch.Tensor]:
    positions = (part.attention_mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=part.input_ids, attention_mask=part.attention_mask, position_ids=positions).logits
    logits = logits[:, part.prompt_width - 1 : -1].float() / TEMPERATURE
    logp = torch.log_softmax(logits, dim=-1)
    taken = logp.gather(-1, part.input_ids[:, part.prompt_width :].unsqueeze(-1)).squeeze(-1)
    return taken, -(logp.exp() * logp).sum(-1)


def aggregate(values, mask, mode):
    """Over the rows given: the token mean, or the mean of the rows' token means."""
    if mode == "token-mean":
        return (values * mask).sum() / mask.sum()
    return ((values * mask).sum(-1) / mask.sum(-1)).mean()


def reference_omega(surprisal, advantages, mask, top_ratio):
    omega = torch.ones_like(surprisal)
    positive = (advantages[:, None] > 0) & mask
    count = int(positive.sum())
    if count:
        k = max(1, math.ceil(top_ratio * count))
        order = torch.argsort(torch.where(positive, surprisal, -math.inf).flatten(), descending=True)[:k]
        omega.view(-1)[order] = W
    return omega


def reference_step(model, parts, alg: AlgorithmConfig, sequences: int):
    """(omega, loss) per micro-batch; gradients accumulate in ``model``."""
    out = []
    for part in parts:
        mask = part.response_mask
        logprobs, _ = reference_logprobs_and_entropy(model, part)
        old = logprobs.detach()
        ratio = torch.exp(logprobs - old)
        adv = part.advantages[:, None].expand_as(logprobs)
        omega = reference_omega(-old, part.advantages, mask, alg.stare.top_ratio)
        clipped = torch.clamp(ratio, 1 - alg.policy_loss.clip_eps_low, 1 + alg.policy_loss.clip_eps_high)
        per_token = torch.maximum(-adv * ratio, -adv * clipped)
        per_token = torch.where(adv < 0, torch.minimum(per_token, -adv * alg.policy_loss.dual_clip_c), per_token)
        loss = aggregate(per_token * omega, mask, alg.update.loss_agg) * part.num_rows / sequences
        loss.backward()
        out.append((omega, loss.detach()))
    return out


# ------------------------------------------------------------------------------------------- the tests


@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-mean"])
def test_official_loss_matches_the_reference_procedure(tiny_dir, loss_agg):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    policy = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    reference = copy.deepcopy(policy)
    experience = fixed_batch(policy.config.vocab_size)
    mask = experience.response_mask

    # The gate: the step's entropy aggregated like the loss.
    with torch.no_grad():
        _, entropy = reference_logprobs_and_entropy(reference, experience)
    want_gate = aggregate(entropy, mask, loss_agg)
    alg = official_config(update={"loss_agg": loss_agg}, stare={"target_entropy": float(want_gate) + 1e-3})
    scores = score_batch(policy, experience, temperature=TEMPERATURE, chunk_size=7, micro_batch_tokens=40)
    gate = gate_entropy(scores.entropy, experience, alg.gate_loss_agg(), max_response_length=MAX_NEW_TOKENS)
    assert gate == pytest.approx(float(want_gate), abs=1e-6)
    params = alg.stare.make_controller().update(gate)
    assert params.gate_on and params.w == W

    # The loss, micro-batch by micro-batch (a 40-token budget: four micro-batches of different sizes). The
    # scoring pass's log-probs are moved off (as a stale or differently batched pass would leave them): on-policy
    # the official semantics must not read them.
    stale = scores.logprobs + 0.05 * torch.randn(scores.logprobs.shape, generator=torch.Generator().manual_seed(1))
    experience = dataclasses.replace(experience, old_logprobs=stale, phi=scores.phi)
    normalizer = step_normalizer(experience, max_response_length=MAX_NEW_TOKENS, device=torch.device("cpu"))
    parts = list(micro_batches(experience, 40))
    assert len(parts) >= 3
    got = []
    for part in parts:
        result = micro_batch_loss(
            policy, None, part, normalizer, LossPlan.resolve(alg), params=params, entropy_coef=0.0,
            temperature=TEMPERATURE, chunk_size=7, selection=TokenSelection.resolve(alg.stare, group_size=1),
        )  # fmt: skip
        result.loss.backward()
        assert float(result.sums["ratio_sum"]) == float(result.sums["tokens"])  # ratio exactly 1 on every token
        got.append((result.stare_omega, result.loss.detach()))
    want = reference_step(reference, parts, alg, experience.num_rows)
    for part, (omega, loss), (want_omega, want_loss) in zip(parts, got, want):
        valid = part.response_mask
        assert torch.equal(torch.where(valid, omega, 1.0), torch.where(valid, want_omega, 1.0))
        assert float(loss) == pytest.approx(float(want_loss), abs=1e-6)
    assert sum(int(((o == W) & p.response_mask).sum()) for (o, _), p in zip(got, parts)) >= len(parts) - 1
    for (name, p), q in zip(policy.named_parameters(), reference.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-6, rtol=1e-5), name


def test_official_old_logprobs_are_the_detached_current_ones_only_on_policy():
    assert official_config().update.on_policy_old_logprobs == "forward"
    with pytest.raises(ValueError, match="on_policy_old_logprobs=forward applies to on-policy steps only"):
        official_config(update={"ppo_epochs": 2})


def _reference_top_surprisal(surprisal, candidates, top_ratio):
    """The reference code's selection inside one micro-batch: topk over the candidates' surprisal, row-major."""
    selected = torch.zeros_like(candidates)
    count = int(candidates.sum())
    if count:
        k = min(count, max(1, int(count * top_ratio + 0.999999)))
        chosen = torch.topk(surprisal[candidates], k=k, largest=True).indices
        selected.view(-1)[candidates.view(-1).nonzero().squeeze(-1)[chosen]] = True
    return selected


def test_exact_ties_are_taken_in_torch_topks_order_under_official_semantics():
    """Surprisals with many exact ties (identical tokens after identical prefixes, as in a group's first
    tokens): with ``tie_order=topk`` L+ and L- are the tokens the reference's ``topk`` takes; by position
    they differ, so the test tells the two orders apart."""
    from tests.test_algorithms_stare import one_part_weights

    g = torch.Generator().manual_seed(2)
    surprisal = torch.randint(1, 4, (6, 10), generator=g).float()
    mask = torch.ones(6, 10, dtype=torch.bool)
    mask[1, 7:] = mask[4, 3:] = False
    advantages = torch.tensor([0.5, -0.5, 1.0, -1.0, 0.2, -0.2])
    stare = official_config().stare
    assert stare.tie_order == "topk"
    selected = {}
    for order in ("topk", "position"):
        _, stats = one_part_weights(-surprisal, advantages, mask, scope="micro_batch", variant="C2",
                                    top_ratio=0.3, k_rounding="reference", tie_order=order)  # fmt: skip
        selected[order] = stats.selected
    for sign in (1, -1):
        candidates = mask & (advantages[:, None] * sign > 0)
        want = _reference_top_surprisal(surprisal, candidates, 0.3)
        assert torch.equal(selected["topk"] & candidates, want)
    assert not torch.equal(selected["topk"], selected["position"])


def test_the_reference_k_rule_and_the_gate_before_any_measurement():
    """k = int(P n + 0.999999) (the reference code) against ceil(P n) (the project): apart only when P n lies
    within 1e-6 above an integer, here P n = 1.0000005; the reference controller's gate starts open."""
    from tests.test_algorithms_stare import one_part_weights

    logprobs = -torch.arange(1.0, 11.0).view(1, 10)  # ten T+ tokens, surprisal 1..10
    mask = torch.ones(1, 10, dtype=torch.bool)
    picked = {}
    for rounding in ("ceil", "reference"):
        _, stats = one_part_weights(
            logprobs, torch.ones(1), mask, scope="micro_batch", top_ratio=0.10000005, w=W, k_rounding=rounding
        )
        picked[rounding] = int(stats.selected_pos)
    assert picked == {"ceil": 2, "reference": 1}
    assert official_config().stare.k_rounding == "reference"
    with pytest.warns(RuntimeWarning, match="non-finite"):
        assert official_config().stare.make_controller().update(float("nan")).gate_on
    with pytest.warns(RuntimeWarning, match="non-finite"):
        assert (
            not dataclasses.replace(official_config().stare, gate_starts_open=False)
            .make_controller()
            .update(float("nan"))
            .gate_on
        )
