"""Packed (padding-free) micro-batches and the fused LM head give the statistics, losses, gradients and STARE
selections of the padded forward, checked against each row's own forward without any padding."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from stare_lightning.algorithms import AlgorithmConfig, StepParams
from stare_lightning.step import Experience, LossPlan, micro_batch_loss, micro_batches
from stare_lightning.step.forward import PADDED, ForwardLayout, PackedRows, response_token_stats
from stare_lightning.step.normalizer import step_normalizer
from stare_lightning.step.scoring import score_batch
from stare_lightning.step.selection import TokenSelection
from tests.experiences import on_policy_experience
from tests.test_official_semantics import official_config

TEMPERATURE = 0.8
LAYOUTS = {
    "packed": ForwardLayout(packed=True),
    "fused": ForwardLayout(fused_head=True),
    "packed+fused": ForwardLayout(packed=True, fused_head=True),
    "packed+shared": ForwardLayout(packed=True, share_prompts=True),
    "packed+shared+fused": ForwardLayout(packed=True, share_prompts=True, fused_head=True),
}


@pytest.fixture(scope="module")
def policy(tiny_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)


def uneven_batch(vocab: int, seed: int = 5) -> Experience:
    """Two groups of three samples (prompts of 4 and 9 tokens, each shared by its group), responses of very
    different lengths (1 to 40 tokens), a tool reply inside one response, advantages of both signs."""
    g = torch.Generator().manual_seed(seed)
    response_lengths = (1, 40, 6, 23, 2, 11)
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (4, 9)]
    prompts = [prompts[0]] * 3 + [prompts[1]] * 3
    responses = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in response_lengths]
    masks = [[True] * n for n in response_lengths]
    masks[3][5:12] = [False] * 7  # a tool reply: attended, never scored by the loss
    advantages = torch.tensor([0.9, -0.4, 1.3, -1.1, 0.6, -0.7])
    return on_policy_experience(prompts, responses, advantages, n=3, policy_masks=masks)


def row_by_row_reference(model, batch: Experience) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row alone, without padding or masks: log-probs and entropy ``[rows, response_width]``."""
    logprobs = torch.zeros(batch.response_mask.shape)
    entropy = torch.zeros(batch.response_mask.shape)
    for row in range(batch.num_rows):
        ids = batch.input_ids[row][batch.attention_mask[row].bool()]
        width = int(batch.attention_mask[row, batch.prompt_width :].sum())
        logits = model(input_ids=ids[None]).logits[0, -width - 1 : -1].float() / TEMPERATURE
        logp = torch.log_softmax(logits, -1)
        logprobs[row, :width] = logp.gather(-1, ids[-width:, None])[:, 0]
        entropy[row, :width] = -(logp.exp() * logp).sum(-1)
    return logprobs, entropy


def test_packed_rows_keep_each_token_and_restart_positions(policy):
    batch = uneven_batch(policy.config.vocab_size)
    packed = PackedRows.of(batch)
    lengths = batch.attention_mask.sum(-1)
    assert packed.input_ids.shape == (1, int(lengths.sum()))
    starts = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)[:-1]])
    assert packed.position_ids[0, starts].eq(0).all()
    # Every present response token is scored by the packed position right before it, holding the previous token.
    scored_tokens = packed.input_ids[0, packed.scoring_index + 1]
    assert torch.equal(scored_tokens, batch.response_ids[packed.present])


def test_shared_prompts_are_laid_out_once(policy):
    batch = uneven_batch(policy.config.vocab_size)
    plain, shared = PackedRows.of(batch), PackedRows.of(batch, share_prompts=True)
    responses = int(batch.attention_mask[:, batch.prompt_width :].sum())
    assert plain.input_ids.shape[1] == responses + 3 * 4 + 3 * 9
    assert shared.input_ids.shape[1] == responses + 4 + 9
    assert plain.attention_mask is None and shared.attention_mask is not None
    # Scored tokens are the ones the padded layout scores, each right after what precedes it in its own row.
    assert torch.equal(shared.input_ids[0, shared.scoring_index], plain.input_ids[0, plain.scoring_index])


@pytest.mark.parametrize("layout", [PADDED, *LAYOUTS.values()], ids=["padded", *LAYOUTS])
def test_statistics_match_each_rows_own_forward(policy, layout):
    batch = uneven_batch(policy.config.vocab_size)
    with torch.no_grad():
        stats = response_token_stats(policy, batch, layout, temperature=TEMPERATURE, chunk_size=7)
        want_logprobs, want_entropy = row_by_row_reference(policy, batch)
    present = batch.attention_mask[:, batch.prompt_width :].bool()
    torch.testing.assert_close(stats.logprobs[present], want_logprobs[present], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(stats.entropy[present], want_entropy[present], atol=1e-5, rtol=1e-5)


def _gradients(policy, batch, layout) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    policy.zero_grad(set_to_none=True)
    stats = response_token_stats(policy, batch, layout, temperature=TEMPERATURE, chunk_size=7)
    mask = batch.response_mask
    weights = torch.linspace(-1.0, 1.0, mask.numel()).view(mask.shape)
    objective = ((stats.logprobs * weights + 0.1 * stats.entropy) * mask).sum()
    objective.backward()
    grads = {name: p.grad.detach().clone() for name, p in policy.named_parameters() if p.grad is not None}
    return objective.detach(), grads


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_gradients_match_the_padded_forward(policy, name):
    batch = uneven_batch(policy.config.vocab_size)
    want_value, want = _gradients(policy, batch, PADDED)
    value, got = _gradients(policy, batch, LAYOUTS[name])
    torch.testing.assert_close(value, want_value, atol=1e-5, rtol=1e-5)
    assert got.keys() == want.keys()
    for param, grad in want.items():
        torch.testing.assert_close(got[param], grad, atol=1e-5, rtol=1e-4, msg=param)


def test_tool_tokens_get_no_gradient_in_the_packed_forward(policy):
    """Changing the tokens the policy did not sample changes nothing the padded forward would not change."""
    batch = uneven_batch(policy.config.vocab_size)
    stats = response_token_stats(policy, batch, LAYOUTS["packed+fused"], temperature=TEMPERATURE, chunk_size=7)
    scored = torch.autograd.grad((stats.logprobs * batch.response_mask).sum(), stats.logprobs)[0]
    assert scored[~batch.response_mask].eq(0).all()


def _official_stare_run(policy, batch, layout):
    """One optimizer step's micro-batches (padded cost, budget 64) under the official semantics, each forwarded
    in ``layout``: (summed loss, tokens selected, accumulated gradients)."""
    alg = official_config(stare=dict(target_entropy=100.0))  # the gate opens
    params = StepParams(gate_on=True, w=3.0, m=1.0)
    normalizer = step_normalizer(batch, max_response_length=40, device=torch.device("cpu"))
    policy.zero_grad(set_to_none=True)
    loss, selected = torch.zeros(()), 0
    for part in micro_batches(batch, 64):
        result = micro_batch_loss(policy, None, part, normalizer, LossPlan.resolve(alg), params=params,
                                  entropy_coef=0.0, temperature=TEMPERATURE, chunk_size=7, layout=layout,
                                  selection=TokenSelection.resolve(alg.stare, group_size=1))  # fmt: skip
        result.loss.backward()
        loss, selected = loss + result.loss.detach(), selected + int(result.stare_selected.sum())
    return loss, selected, {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_stare_losses_selection_and_gradients_are_unchanged(policy, name):
    """The official semantics select inside each micro-batch from its own forward: the selection, the loss and
    the accumulated gradients are the padded layout's on the same micro-batches."""
    batch = uneven_batch(policy.config.vocab_size)
    want_loss, want_selected, want_grads = _official_stare_run(policy, batch, PADDED)
    loss, selected, grads = _official_stare_run(policy, batch, LAYOUTS[name])
    torch.testing.assert_close(loss, want_loss, atol=1e-6, rtol=1e-5)
    assert selected == want_selected > 0
    for param, grad in want_grads.items():
        torch.testing.assert_close(grads[param], grad, atol=1e-5, rtol=1e-4, msg=param)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_the_step_scope_selection_is_unchanged(policy, name):
    """The project's default: one selection over the step's batch from the scoring pass."""
    batch = uneven_batch(policy.config.vocab_size)
    alg = dataclasses.replace(AlgorithmConfig(), stare=dataclasses.replace(official_config().stare, scope="step"))
    params = StepParams(gate_on=True, w=3.0, m=1.0)
    selections = []
    for layout in (PADDED, LAYOUTS[name]):
        scores = score_batch(policy, batch, temperature=TEMPERATURE, chunk_size=7, micro_batch_tokens=64,
                             layout=layout)  # fmt: skip
        selection = TokenSelection.resolve(alg.stare, group_size=3).over_step(scores, batch, params)
        selections.append(selection.selected)
    assert selections[0].any() and torch.equal(selections[0], selections[1])


def test_packed_micro_batches_budget_real_tokens_not_padding(policy):
    batch = uneven_batch(policy.config.vocab_size)
    lengths = batch.attention_mask.sum(-1)
    budget = int(lengths.max())
    padded, packed = list(micro_batches(batch, budget)), list(micro_batches(batch, budget, packed=True))
    assert sum(p.num_rows for p in packed) == sum(p.num_rows for p in padded) == batch.num_rows
    assert all(int(p.attention_mask.sum()) <= budget or p.num_rows == 1 for p in packed)
    assert len(packed) < len(padded)  # the short rows share a micro-batch with the long one's leftovers


def test_fused_head_refuses_models_whose_head_it_cannot_reproduce(policy):
    from stare_lightning.step.forward import decoder_and_head

    decoder_and_head(policy)  # a plain Llama head is fine
    policy.config.final_logit_softcapping = 30.0
    try:
        with pytest.raises(ValueError, match="final_logit_softcapping"):
            decoder_and_head(policy)
    finally:
        del policy.config.final_logit_softcapping
