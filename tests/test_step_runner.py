"""The step runner on its own, in seconds: the tiny model, a scripted sampler, no Lightning.

Each test checks the runner against a reference computed another way: the on-policy gradient against
-A log pi summed over rows forwarded one at a time, the optimizer steps of PPO epochs and mini-batches against
the rows they must cover, the mismatch correction's token weights against min(pi_train / pi_rollout, cap), two gloo
ranks with unequal micro-batch counts (zero-weight fillers) against one process holding every row, and the plan
against the config it is resolved from.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from stare_lightning.algorithms import AlgorithmConfig, STAREConfig
from stare_lightning.rewards.pool import VerifierPool
from stare_lightning.rollout.base import Rollouts, SamplingParams
from stare_lightning.rollout.config import RolloutConfig
from stare_lightning.step.collect import Collection, CollectionStats
from stare_lightning.step.config import ForwardConfig
from stare_lightning.step.plan import StepPlan
from stare_lightning.step.runner import StepRunner
from stare_lightning.step.selection import SelectionTiming
from tests.distributed import run_on_ranks
from tests.experiences import on_policy_experience

TEMPERATURE = 0.7
N = 2  # samples per prompt


def _plan(alg: AlgorithmConfig, micro_batch_tokens: int = 40) -> StepPlan:
    rollout = RolloutConfig(n=N, temperature=TEMPERATURE, max_new_tokens=12)
    return StepPlan.resolve(alg, rollout, ForwardConfig(micro_batch_tokens=micro_batch_tokens, logprob_chunk_size=7))


def _rows(vocab: int, seed: int = 3):
    """Eight rows of different prompt and response lengths; advantages of both signs, one zero."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (3, 3, 5, 5, 4, 4, 6, 6)]
    responses = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (7, 2, 9, 4, 12, 5, 3, 8)]
    advantages = torch.tensor([0.8, -0.8, 0.5, -0.5, 1.0, -1.0, 0.0, 0.7])
    return prompts, responses, advantages


def _collection(batch) -> Collection:
    groups = batch.num_rows // N
    return Collection(
        batch=batch,
        items=[{"id": str(g)} for g in range(groups)],
        texts=[""] * batch.num_rows,
        truncated=torch.zeros(batch.num_rows, dtype=torch.bool),
        correct=torch.zeros(groups, N),
        stats=CollectionStats(),
        episodes=[],
    )


def _reference_logprobs(policy, prompts, responses) -> list[torch.Tensor]:
    """Each row forwarded alone (no padding, no batching): the log-probs of its response tokens at TEMPERATURE."""
    out = []
    for prompt, response in zip(prompts, responses):
        ids = torch.tensor([prompt + response])
        logits = policy(input_ids=ids).logits[0, len(prompt) - 1 : -1] / TEMPERATURE
        out.append(torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(response)[:, None])[:, 0])
    return out


@torch.no_grad()
def _reference_entropy(policy, prompts, responses) -> float:
    """The token mean, over every response token, of the entropy of softmax(logits / TEMPERATURE)."""
    total, tokens = 0.0, 0
    for prompt, response in zip(prompts, responses):
        logits = policy(input_ids=torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1] / TEMPERATURE
        logp = torch.log_softmax(logits.double(), -1)
        total += float(-(logp.exp() * logp).sum())
        tokens += len(response)
    return total / tokens


class GradientRecorder:
    """An ``optimizer_step`` that keeps a copy of the gradients, then applies SGD (or not) and clears them."""

    def __init__(self, policy, lr: float = 0.0) -> None:
        self.policy, self.lr, self.grads, self.finite = policy, lr, [], []

    def __call__(self, finite: bool) -> float:
        grads = {n: p.grad.detach().clone() for n, p in self.policy.named_parameters() if p.grad is not None}
        self.grads.append(grads)
        self.finite.append(finite)
        with torch.no_grad():
            for p in self.policy.parameters():
                if p.grad is not None:
                    p -= self.lr * p.grad
                    p.grad = None
        return float(torch.sqrt(sum((g.double() ** 2).sum() for g in grads.values())))


@pytest.fixture
def policy(tiny_dir):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)


def test_the_plan_follows_the_config():
    stare = STAREConfig(enabled=True)
    grpo = _plan(AlgorithmConfig())
    assert not grpo.scoring_pass and grpo.selection is SelectionTiming.STEP and not grpo.reselect
    assert grpo.gate_aggregation == "token-mean" and not grpo.loss.micro_batch_token_mean
    off_policy = _plan(AlgorithmConfig(update={"ppo_epochs": 2}))
    assert off_policy.scoring_pass and not off_policy.reselect and not off_policy.loss.old_logprobs_from_forward
    assert _plan(AlgorithmConfig(entropy_bonus={"target": 0.5})).scoring_pass  # the adaptive coefficient needs H first
    step_scope = _plan(AlgorithmConfig(stare=stare))
    assert step_scope.scoring_pass and step_scope.selection is SelectionTiming.OPTIMIZER_STEP and step_scope.reselect
    inside = _plan(AlgorithmConfig(stare=dataclasses.replace(stare, scope="micro_batch")))
    assert inside.selection is SelectionTiming.MICRO_BATCH and not inside.reselect
    official = _plan(
        AlgorithmConfig(
            stare=dataclasses.replace(stare, scope="micro_batch", gate_aggregation="like_loss"),
            update={
                "loss_agg": "seq-mean-token-mean",
                "loss_normalizer": "micro_batch",
                "on_policy_old_logprobs": "forward",
            },
        )
    )
    assert official.loss.old_logprobs_from_forward and official.gate_aggregation == "seq-mean-token-mean"
    assert not official.loss.micro_batch_token_mean  # a micro-batch's own token mean applies to token-mean only
    own_mean = AlgorithmConfig(update={"loss_normalizer": "micro_batch"})
    assert _plan(own_mean).loss.micro_batch_token_mean
    assert official.forward.temperature == TEMPERATURE and official.forward.micro_batch_tokens == 40


def test_an_on_policy_step_is_the_policy_gradient_of_its_rows(policy):
    """GRPO without a scoring pass, four or more micro-batches: one optimizer step whose gradient is that of
    -sum(A log pi) / tokens (ratio 1), and whose statistics are the rollout policy's."""
    prompts, responses, advantages = _rows(policy.config.vocab_size)
    batch = on_policy_experience(prompts, responses, advantages, n=N)
    alg = AlgorithmConfig(policy_loss={"clip_eps_high": 0.28})
    recorder = GradientRecorder(policy)
    runner = StepRunner(_plan(alg, micro_batch_tokens=20), verifiers=None, sampling=None, pad_token_id=0,
                        policy=policy, optimizer_step=recorder)  # fmt: skip
    phases = []
    result = runner.learn(_collection(batch), seed=1, lap=phases.append)
    assert phases == ["telemetry", "score", "update", "telemetry"]
    assert len(recorder.grads) == 1 and recorder.finite == [True] and len(result.micro_batch_sums) >= 4

    logprobs = _reference_logprobs(policy, prompts, responses)
    tokens = sum(len(r) for r in responses)
    reference_loss = -sum(a * lp.sum() for a, lp in zip(advantages, logprobs)) / tokens
    policy.zero_grad()
    reference_loss.backward()
    for name, p in policy.named_parameters():
        assert torch.allclose(recorder.grads[0][name], p.grad, atol=1e-6, rtol=1e-4), name
    for row, lp in enumerate(logprobs):  # the first forward's statistics are the rollout policy's
        assert torch.allclose(result.scores.logprobs[row, : len(lp)], lp.detach(), atol=1e-5)
    assert result.params.gate_on is False and len(result.selections) == 1  # what STARE would have selected
    assert sum(float(s["tokens"]) for s in result.micro_batch_sums) == tokens


def test_token_mismatch_correction_weights_each_token_by_its_capped_ratio(policy):
    """algorithm.mismatch.correction=token: each token's loss is weighted by min(pi_train / pi_rollout, cap), the
    engine's log-prob being what it reported (-1 nats for every token here). The weights are computed here from that
    definition, the cap set between the ratios so that some tokens are capped and some not; the step's gradient is
    that of -sum(A w log pi) / tokens (ratio 1, w carrying no gradient)."""
    prompts, responses, advantages = _rows(policy.config.vocab_size)
    batch = on_policy_experience(prompts, responses, advantages, n=N)
    assert (batch.rollout_logprobs[batch.response_mask.bool()] == -1.0).all()
    with torch.no_grad():
        ratios = [torch.exp(lp - -1.0) for lp in _reference_logprobs(policy, prompts, responses)]
    cap = float(torch.cat(ratios).median())
    weights = [ratio.clamp(max=cap) for ratio in ratios]
    capped = sum(int((ratio > cap).sum()) for ratio in ratios)
    assert 0 < capped < sum(len(r) for r in responses)  # both sides of the cap are exercised

    alg = AlgorithmConfig(mismatch={"correction": "token", "cap": cap})
    recorder = GradientRecorder(policy)
    runner = StepRunner(_plan(alg, micro_batch_tokens=20), verifiers=None, sampling=None, pad_token_id=0,
                        policy=policy, optimizer_step=recorder)  # fmt: skip
    runner.learn(_collection(batch), seed=1)
    assert len(recorder.grads) == 1

    logprobs = _reference_logprobs(policy, prompts, responses)
    tokens = sum(len(r) for r in responses)
    reference_loss = -sum(a * (w * lp).sum() for a, w, lp in zip(advantages, weights, logprobs)) / tokens
    policy.zero_grad()
    reference_loss.backward()
    for name, p in policy.named_parameters():
        assert torch.allclose(recorder.grads[0][name], p.grad, atol=1e-7, rtol=1e-4), name


def test_epochs_and_mini_batches_cover_every_row_once_per_epoch(policy):
    """Two PPO epochs x two mini-batches with STARE's step scope (a re-selection before every optimizer step
    after the first): four optimizer steps, each mini-batch's rows once per epoch, the policy moving between."""
    prompts, responses, advantages = _rows(policy.config.vocab_size)
    batch = on_policy_experience(prompts, responses, advantages, n=N)
    alg = AlgorithmConfig(
        stare=STAREConfig(enabled=True, target_entropy=100.0, w=3.0), update={"ppo_epochs": 2, "mini_batches": 2}
    )
    recorder = GradientRecorder(policy, lr=0.5)
    before = {n: p.detach().clone() for n, p in policy.named_parameters()}
    with torch.no_grad():  # the rollout policy's statistics at the sampling temperature, row by row
        want_logprobs = _reference_logprobs(policy, prompts, responses)
        want_entropy = _reference_entropy(policy, prompts, responses)
    runner = StepRunner(_plan(alg, micro_batch_tokens=30), verifiers=None, sampling=None, pad_token_id=0,
                        policy=policy, optimizer_step=recorder, controller=alg.stare.make_controller())  # fmt: skip
    result = runner.learn(_collection(batch), seed=5)
    assert len(result.grad_norms) == len(recorder.grads) == 4
    # The scoring pass (old log-probs, the gate's entropy) ran at TEMPERATURE, not at the logits' temperature 1.
    for row, lp in enumerate(want_logprobs):
        assert torch.allclose(result.scores.logprobs[row, : len(lp)], lp, atol=1e-5), row
    assert result.entropy == pytest.approx(want_entropy, rel=1e-5)
    # The update's first forward sees the policy the scoring pass saw, at the same temperature: every ratio is 1.
    first = result.micro_batch_sums[0]
    assert float(first["ratio_sum"]) == pytest.approx(float(first["tokens"]), rel=1e-6)
    tokens = sum(len(r) for r in responses)
    assert sum(float(s["tokens"]) for s in result.micro_batch_sums) == 2 * tokens
    # Every micro-batch applied a step-wide selection (gate open): its slice of omega, W on selected T+ tokens.
    assert result.params.gate_on and len(result.selections) == len(result.micro_batch_sums)
    up_weighted = 0
    for chosen in result.selections:
        positive = (chosen.advantages[:, None] > 0) & chosen.selected & chosen.mask  # O1: W on selected T+ only
        assert chosen.omega is not None and (chosen.omega[positive] == 3.0).all()
        up_weighted += int(positive.sum())
    assert up_weighted > 0
    assert any(not torch.equal(p.detach(), before[n]) for n, p in policy.named_parameters())


def _rank_step(rank: int, world: int, tiny_dir: str, rows_of_rank: list[list[int]]) -> dict:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    policy = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    prompts, responses, advantages = _rows(policy.config.vocab_size)
    mine = rows_of_rank[rank]
    batch = on_policy_experience([prompts[i] for i in mine], [responses[i] for i in mine], advantages[mine], n=1)
    alg = AlgorithmConfig()

    def mean_over_ranks(finite: bool) -> float:  # what DDP and FSDP do to gradients
        for p in policy.parameters():
            if p.grad is not None and world > 1:
                torch.distributed.all_reduce(p.grad)
                p.grad /= world
        return 0.0

    grads = {}

    def keep(finite: bool) -> float:
        mean_over_ranks(finite)
        grads.update({n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None})
        return 0.0

    runner = StepRunner(_plan(alg, micro_batch_tokens=20), verifiers=None, sampling=None, pad_token_id=0,
                        policy=policy, optimizer_step=keep, world_size=world)  # fmt: skip
    result = runner.learn(_collection(batch), seed=0)
    return {"grads": grads, "micro_batches": len(result.micro_batch_sums)}


def test_a_rank_with_fewer_micro_batches_runs_fillers_and_the_gradient_is_the_whole_batch(tiny_dir, tmp_path):
    rows_of_rank = [[0, 2, 4, 7], [1, 6]]  # rank 0: long rows, several micro-batches; rank 1: one
    ranks = run_on_ranks(_rank_step, tmp_path, str(tiny_dir), rows_of_rank)
    assert ranks[0]["micro_batches"] > ranks[1]["micro_batches"] == 1
    whole = _rank_step(0, 1, str(tiny_dir), [[0, 2, 4, 7, 1, 6]])
    for name, grad in whole["grads"].items():
        for rank in (0, 1):
            assert torch.allclose(ranks[rank]["grads"][name], grad, atol=1e-6, rtol=1e-4), (rank, name)


class ScriptedSampler:
    """Answers every prompt with ``N`` responses: token rows drawn from ``seed`` and the texts of ``script``."""

    def __init__(self, script: list[str], vocab: int) -> None:
        self.script, self.vocab = script, vocab

    def generate(self, prompt_ids, params, seeds=None) -> Rollouts:
        g = torch.Generator().manual_seed(len(prompt_ids))
        rows = len(prompt_ids) * params.n
        responses = [torch.randint(3, self.vocab, (3 + i % 4,), generator=g).tolist() for i in range(rows)]
        return Rollouts(
            prompt_ids=[ids for ids in prompt_ids for _ in range(params.n)],
            response_ids=responses,
            response_logprobs=[[-1.0] * len(r) for r in responses],
            texts=[self.script[i % len(self.script)] for i in range(len(responses))],
            finish_reasons=["stop"] * len(responses),
            n=params.n,
        )


def test_collect_then_learn_against_a_scripted_sampler(policy):
    """The whole step from prompts: rewards from the verifier, group advantages, the update on the kept rows."""
    alg = AlgorithmConfig()
    recorder = GradientRecorder(policy)
    prompts = [{"id": str(i), "prompt_ids": [5 + i, 6, 7], "verifier": "exact", "answer": "yes"} for i in range(3)]
    with VerifierPool() as verifiers:
        runner = StepRunner(_plan(alg), verifiers=verifiers, sampling=SamplingParams(n=N, max_new_tokens=8),
                            pad_token_id=0, policy=policy, optimizer_step=recorder)  # fmt: skip
        collection = runner.collect(prompts, ScriptedSampler(["yes", "no"], policy.config.vocab_size), seed=0)
    assert collection.correct.tolist() == [[1.0, 0.0]] * 3
    assert collection.batch.advantages[0] > 0 > collection.batch.advantages[1]
    result = runner.learn(collection, seed=0)
    assert len(recorder.grads) == 1 and result.entropy > 0
    assert result.batch.num_rows == 6 and len(result.selections) == 1
    # The update ran at the sampling temperature: its statistics and its gradient are those of the log-probs of
    # softmax(logits / TEMPERATURE), computed row by row from the sampler's rows (no group was filtered out).
    rows = ScriptedSampler(["yes", "no"], policy.config.vocab_size).generate(
        [p["prompt_ids"] for p in prompts], SamplingParams(n=N, max_new_tokens=8)
    )
    logprobs = _reference_logprobs(policy, rows.prompt_ids, rows.response_ids)
    for row, lp in enumerate(logprobs):
        assert torch.allclose(result.scores.logprobs[row, : len(lp)], lp.detach(), atol=1e-5), row
    assert result.entropy == pytest.approx(_reference_entropy(policy, rows.prompt_ids, rows.response_ids), rel=1e-5)
    advantages = collection.batch.advantages
    tokens = sum(len(r) for r in rows.response_ids)
    policy.zero_grad()
    (-sum(a * lp.sum() for a, lp in zip(advantages, logprobs)) / tokens).backward()
    for name, p in policy.named_parameters():
        assert torch.allclose(recorder.grads[0][name], p.grad, atol=1e-6, rtol=1e-4), name
