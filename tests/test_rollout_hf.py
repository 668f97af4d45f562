"""HFRolloutEngine on the real tiny model: grouping, EOS handling, log-probs, seeding, FSDP2."""

from __future__ import annotations

import pytest
import torch

from stare_lightning.rollout.base import RolloutEngine, Rollouts, SamplingParams
from stare_lightning.rollout.hf import HFRolloutEngine
from tests.distributed import run_on_ranks


@pytest.fixture()
def model_and_tokenizer(tiny_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(tiny_dir), AutoTokenizer.from_pretrained(tiny_dir)


PROMPTS = ["1+1=", "The capital of France is", "x"]


def _prompt_ids(tokenizer):
    return [tokenizer.encode(p) for p in PROMPTS]


def _trainer_logprobs(model, prompt, response, temperature):
    """What a trainer computes: one forward over prompt + response, log_softmax(logits / T) at each token."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1]
    return torch.log_softmax(logits / temperature, -1).gather(-1, torch.tensor(response)[:, None]).squeeze(-1)


def test_shapes_and_grouping(model_and_tokenizer):
    model, tok = model_and_tokenizer
    engine = HFRolloutEngine(model, tok)
    assert isinstance(engine, RolloutEngine)
    assert engine.holds_weight_copy is False  # samples from the policy module itself
    prompts = _prompt_ids(tok)
    out = engine.generate(prompts, SamplingParams(n=4, max_new_tokens=12, seed=0))
    assert isinstance(out, Rollouts)
    assert out.n == 4 and out.num_groups == len(prompts) and len(out.response_ids) == 12
    for i, p in enumerate(prompts):
        assert all(row == p for row in out.prompt_ids[i * 4 : (i + 1) * 4])
    for ids, lps, text, reason in zip(out.response_ids, out.response_logprobs, out.texts, out.finish_reasons):
        assert 1 <= len(ids) <= 12 and len(lps) == len(ids)
        assert all(lp <= 0 for lp in lps)
        assert text == tok.decode(ids, skip_special_tokens=True)
        assert reason in ("stop", "length")
    assert out.num_tokens == sum(len(r) for r in out.response_ids)
    assert out.generation_seconds > 0
    # samples within a group differ (random model, temperature 1)
    assert len({tuple(r) for r in out.response_ids[:4]}) > 1


def test_no_prompts_no_rows(model_and_tokenizer):
    model, tok = model_and_tokenizer
    out = HFRolloutEngine(model, tok).generate([], SamplingParams(n=2, max_new_tokens=4, seed=0))
    assert out.response_ids == [] and out.num_groups == 0


def test_eos_cut_and_finish_reasons(model_and_tokenizer):
    model, tok = model_and_tokenizer
    engine = HFRolloutEngine(model, tok)
    eos = tok.eos_token_id
    # The random model puts about 1/104 on EOS per step: over 16 rows x 64 steps both outcomes occur.
    out = engine.generate([tok.encode("go")], SamplingParams(n=16, max_new_tokens=64, temperature=1.5, seed=7))
    assert set(out.finish_reasons) == {"stop", "length"}
    for ids, reason in zip(out.response_ids, out.finish_reasons):
        if reason == "stop":
            assert ids[-1] == eos and eos not in ids[:-1]  # cut at and including the first EOS
        else:
            assert len(ids) == 64 and eos not in ids


def test_custom_stop_ids(model_and_tokenizer):
    model, tok = model_and_tokenizer
    vocab = tok.get_vocab()
    stops = [vocab[c] for c in "abcdefghijklmnopqrstuvwxyz"]
    engine = HFRolloutEngine(model, tok, eos_token_ids=stops)
    out = engine.generate([tok.encode("go")], SamplingParams(n=8, max_new_tokens=100, seed=1))
    for ids, reason in zip(out.response_ids, out.finish_reasons):
        assert reason == "stop" and ids[-1] in stops and not set(ids[:-1]) & set(stops)


def test_stop_strings_and_per_prompt_budgets(model_and_tokenizer):
    """A row ends at the token that completes its first stop string (kept), at EOS, or at its own budget; the
    prefix before the stop is the sample a run without stop strings draws (same seeds)."""
    model, tok = model_and_tokenizer
    engine = HFRolloutEngine(model, tok)
    prompts, stop = _prompt_ids(tok), ("e", "42")
    budgets = [5, 30, 17]
    params = SamplingParams(n=6, max_new_tokens=30, seed=3, stop=stop)
    out = engine.generate(prompts, params, max_new_tokens=budgets)
    free = engine.generate(prompts, SamplingParams(n=6, max_new_tokens=30, seed=3))
    stopped = 0
    for row, (ids, reason) in enumerate(zip(out.response_ids, out.finish_reasons)):
        budget = budgets[row // 6]
        assert 1 <= len(ids) <= budget
        assert free.response_ids[row][: len(ids)] == ids  # stopping never changes what was drawn before
        texts = [tok.decode(ids[:t], skip_special_tokens=True) for t in range(1, len(ids) + 1)]
        first_hit = next((t + 1 for t, text in enumerate(texts) if any(s in text for s in stop)), None)
        if first_hit is not None:  # the first stop string ends the response, with the token that completes it
            assert first_hit == len(ids) and reason == "stop"
            stopped += 1
        elif reason == "stop":
            assert ids[-1] == tok.eos_token_id
        else:
            assert len(ids) == budget
    assert stopped > 0, "no row hit a stop string: the property is not exercised"


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_match_a_separate_forward(model_and_tokenizer, temperature):
    model, tok = model_and_tokenizer
    engine = HFRolloutEngine(model, tok)
    out = engine.generate(_prompt_ids(tok), SamplingParams(n=3, max_new_tokens=20, temperature=temperature, seed=3))
    model.eval()
    for prompt, resp, lps in zip(out.prompt_ids, out.response_ids, out.response_logprobs):
        ref = _trainer_logprobs(model, prompt, resp, temperature)
        torch.testing.assert_close(torch.tensor(lps), ref, atol=1e-5, rtol=0)


def test_top_k_restricts_samples(model_and_tokenizer):
    model, tok = model_and_tokenizer
    out = HFRolloutEngine(model, tok).generate(
        [tok.encode("ab")], SamplingParams(n=4, max_new_tokens=10, top_k=3, seed=0)
    )
    model.eval()
    for prompt, resp in zip(out.prompt_ids, out.response_ids):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + resp])).logits[0, len(prompt) - 1 : -1]
        top3 = logits.topk(3, dim=-1).indices
        assert all(tok_id in top3[t] for t, tok_id in enumerate(resp))


def test_same_seed_same_rollouts_and_rng_untouched(model_and_tokenizer):
    model, tok = model_and_tokenizer
    engine = HFRolloutEngine(model, tok, max_batch_size=4)  # chunking must not break reproducibility
    params = SamplingParams(n=3, max_new_tokens=16, seed=11)
    before = torch.get_rng_state()
    a = engine.generate(_prompt_ids(tok), params)
    assert torch.equal(before, torch.get_rng_state())
    b = engine.generate(_prompt_ids(tok), params)
    c = engine.generate(_prompt_ids(tok), SamplingParams(n=3, max_new_tokens=16, seed=12))
    assert a.response_ids == b.response_ids and a.response_logprobs == b.response_logprobs
    assert a.response_ids != c.response_ids


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9)])
def test_samples_follow_the_warped_softmax(model_and_tokenizer, temperature, top_p):
    """Frequencies of 6000 one-token samples against softmax(z / T) restricted to the top-p nucleus."""
    model, tok = model_and_tokenizer
    prompt = tok.encode("1+1=")
    rows = 6000
    out = HFRolloutEngine(model, tok).generate(
        [prompt], SamplingParams(n=rows, max_new_tokens=1, temperature=temperature, top_p=top_p, seed=5)
    )
    model.eval()
    with torch.no_grad():
        probs = torch.softmax(model(torch.tensor([prompt])).logits[0, -1].double() / temperature, -1)
    # The nucleus: the most likely tokens until their mass reaches top_p (the token crossing it included).
    order = probs.argsort(descending=True)
    mass_before = probs[order].cumsum(0) - probs[order]
    nucleus = order[mass_before < top_p]
    expected = torch.zeros_like(probs)
    expected[nucleus] = probs[nucleus] / probs[nucleus].sum()
    counts = torch.bincount(torch.tensor([r[0] for r in out.response_ids]), minlength=probs.numel()).double()
    freq = counts / rows
    assert freq[expected == 0].sum() == 0, "a token outside the nucleus was sampled"
    sigma = (expected * (1 - expected) / rows).sqrt()
    assert ((freq - expected).abs() <= 4.5 * sigma + 1e-9).all(), (freq - expected).abs().max()


def test_a_prompts_samples_do_not_depend_on_its_batch(model_and_tokenizer):
    model, tok = model_and_tokenizer
    params = SamplingParams(n=3, max_new_tokens=16, temperature=1.2)
    prompt, others = tok.encode("1+1="), [tok.encode("The capital of France is"), tok.encode("x")]
    alone = HFRolloutEngine(model, tok).generate([prompt], params, seeds=[1234])
    # Other prompts around it, left padding to a longer width, and chunks that split its group.
    crowded = HFRolloutEngine(model, tok, max_batch_size=2).generate(
        [others[0], prompt, others[1]], params, seeds=[7, 1234, 99]
    )
    assert crowded.response_ids[3:6] == alone.response_ids
    torch.testing.assert_close(
        torch.tensor(sum(crowded.response_logprobs[3:6], [])),
        torch.tensor(sum(alone.response_logprobs, [])),
        atol=1e-5,
        rtol=0,
    )
    other_seed = HFRolloutEngine(model, tok).generate([prompt], params, seeds=[1235])
    assert other_seed.response_ids[0] == alone.response_ids[1], "sample j of seed s is drawn from stream s + j"
    with pytest.raises(ValueError, match="one seed per prompt"):
        HFRolloutEngine(model, tok).generate([prompt], params, seeds=[1, 2])


def test_training_flags_restored(model_and_tokenizer):
    model, tok = model_and_tokenizer
    model.train()
    model.model.embed_tokens.eval()  # a deliberately frozen part keeps its own mode
    HFRolloutEngine(model, tok).generate([tok.encode("a")], SamplingParams(n=1, max_new_tokens=2, seed=0))
    assert model.training and model.model.layers[0].training
    assert not model.model.embed_tokens.training


def _fsdp_worker(rank: int, world: int, tiny_dir: str):
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    # Rank 0 stops at its first letter, rank 1 only at EOS: the ranks finish at different steps, so
    # forward calls must stay in lockstep (synced generation) or the all-gathers would hang.
    letters = [tok.get_vocab()[c] for c in "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"]
    # Rank 0 also has twice the prompts, so two generate calls (2 rows each) against rank 1's one.
    engine = HFRolloutEngine(model, tok, eos_token_ids=letters if rank == 0 else None, max_batch_size=2)
    prompts = [tok.encode("rank zero prompt"), tok.encode("zero")] if rank == 0 else [tok.encode("r1")]
    out = engine.generate(prompts, SamplingParams(n=2, max_new_tokens=24, temperature=1.3, seed=rank))
    return out.prompt_ids, out.response_ids, out.response_logprobs, out.finish_reasons


@pytest.mark.slow
def test_fsdp2_sharded_module_generates_on_two_ranks(tiny_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    results = run_on_ranks(_fsdp_worker, tmp_path, str(tiny_dir))
    reference = AutoModelForCausalLM.from_pretrained(tiny_dir).eval()
    for rank in (0, 1):
        prompts, responses, logprobs, reasons = results[rank]
        assert len(responses) == (4 if rank == 0 else 2)
        if rank == 0:
            assert set(reasons) == {"stop"} and max(len(r) for r in responses) < 24
        for prompt, resp, lps in zip(prompts, responses, logprobs):
            ref = _trainer_logprobs(reference, prompt, resp, 1.3)
            torch.testing.assert_close(torch.tensor(lps), ref, atol=1e-5, rtol=0)
