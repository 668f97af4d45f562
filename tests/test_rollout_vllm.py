"""VLLMRolloutEngine with the real vLLM engine (CPU here): log-prob agreement, weight sync, seeding, FSDP2."""

from __future__ import annotations

import copy
import logging
import sys

import pytest
import torch

from stare_lightning.rollout.base import RolloutEngine, SamplingParams
from stare_lightning.rollout.vllm import vllm_import_error
from tests.distributed import run_on_ranks
from tests.needs import require

# One xdist worker runs this module: its tests share one engine (a module fixture, about 10 s to start).
pytestmark = pytest.mark.xdist_group("vllm_engine")


@pytest.fixture(scope="module")
def tokenizer(tiny_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_dir)


@pytest.fixture()
def policy(tiny_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_dir).eval()


@pytest.fixture(scope="module")
def engine(tiny_dir):
    require("vllm")
    from stare_lightning.rollout.vllm import VLLMRolloutEngine

    eng = VLLMRolloutEngine(tiny_dir, max_model_len=256, kv_cache_memory_bytes=64 << 20)
    yield eng
    eng.close()


def _trainer_logprobs(model, prompt, response, temperature=1.0):
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1]
    return torch.log_softmax(logits / temperature, -1).gather(-1, torch.tensor(response)[:, None]).squeeze(-1)


def _max_abs_diff(model, rollouts, temperature=1.0):
    worst = 0.0
    for prompt, resp, lps in zip(rollouts.prompt_ids, rollouts.response_ids, rollouts.response_logprobs):
        ref = _trainer_logprobs(model, prompt, resp, temperature)
        worst = max(worst, (ref - torch.tensor(lps)).abs().max().item())
    return worst


def _train_a_little(policy, tokenizer):
    """Four large AdamW steps on one sentence: log-probs move far beyond any kernel noise."""
    policy.train()
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-2)
    batch = torch.tensor([tokenizer.encode("the answer is 42.") + [tokenizer.eos_token_id]])
    for _ in range(4):
        policy(batch, labels=batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    policy.eval()


def test_missing_vllm_error_says_how_to_install(tiny_dir, monkeypatch):
    from stare_lightning.rollout.vllm import VLLMRolloutEngine

    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` fails as if it were not installed
    assert "import of vllm halted" in vllm_import_error()
    with pytest.raises(ImportError) as err:
        VLLMRolloutEngine(tiny_dir)
    assert "make install" in str(err.value) and "rollout=hf" in str(err.value)


def test_rollout_auto_without_vllm_falls_back_to_hf_and_says_so(monkeypatch, caplog):
    """A missing vLLM (None in sys.modules: `import vllm` fails as if it were not installed) turns rollout=auto
    into the HF engine, with a warning that names the reason; an explicit backend is taken as it is."""
    from stare_lightning.rollout.factory import resolve_backend

    monkeypatch.setitem(sys.modules, "vllm", None)
    with caplog.at_level(logging.WARNING, logger="stare_lightning.rollout.factory"):
        assert resolve_backend("auto") == "hf"
    (record,) = [r for r in caplog.records if r.name == "stare_lightning.rollout.factory"]
    assert record.levelno == logging.WARNING
    assert "rollout=auto: vLLM is not usable here (ModuleNotFoundError" in record.getMessage()
    assert "HF engine" in record.getMessage() and "make install" in record.getMessage()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="stare_lightning.rollout.factory"):
        assert (resolve_backend("hf"), resolve_backend("vllm")) == ("hf", "vllm")
    assert not caplog.records


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_generate_grouping_and_logprobs_match_trainer(engine, tokenizer, policy, temperature):
    assert isinstance(engine, RolloutEngine)
    assert engine.holds_weight_copy is True
    prompts = [tokenizer.encode("1+1="), tokenizer.encode("hello"), tokenizer.encode("x")]
    out = engine.generate(prompts, SamplingParams(n=4, max_new_tokens=16, temperature=temperature, seed=0))
    assert out.n == 4 and out.num_groups == 3 and len(out.response_ids) == 12
    for i, p in enumerate(prompts):
        assert all(row == p for row in out.prompt_ids[i * 4 : (i + 1) * 4])
    for ids, lps, text, reason in zip(out.response_ids, out.response_logprobs, out.texts, out.finish_reasons):
        assert 1 <= len(ids) <= 16 and len(lps) == len(ids) and reason in ("stop", "length")
        assert text == tokenizer.decode(ids, skip_special_tokens=True)
    assert len({tuple(r) for r in out.response_ids[:4]}) > 1
    # processed_logprobs: log_softmax(logits / T) over the full vocabulary, as the trainer computes it
    assert _max_abs_diff(policy, out, temperature) < 1e-4


@pytest.mark.vllm
def test_an_eager_cpu_engine_samples_without_compiling_and_leaves_torch_compile_on(engine, tokenizer):
    """vLLM's one torch.compile'd sampler helper (the sampled token's rank) runs eagerly under the eager CPU engine:
    dynamo never traced it in this process, however many requests the engines here have served with log-probs.
    Outside the engine's calls the process compiles as before."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    from vllm.v1.sample.ops.logprobs import batched_count_greater_than

    out = engine.generate([tokenizer.encode("1+1=")], SamplingParams(n=2, max_new_tokens=4, seed=0))
    assert all(out.response_logprobs)  # log-probs were asked for: the helper ran
    assert _debug_get_cache_entry_list(batched_count_greater_than._torchdynamo_orig_callable.__code__) == []

    def doubled(x):
        return 2 * x

    compiled = torch.compile(doubled, backend="eager")
    assert torch.equal(compiled(torch.ones(3)), torch.full((3,), 2.0))
    assert len(_debug_get_cache_entry_list(doubled.__code__)) == 1


@pytest.mark.slow
@pytest.mark.vllm
def test_eos_is_kept_and_ends_the_response(engine, tokenizer):
    eos = tokenizer.eos_token_id
    out = engine.generate([tokenizer.encode("go")], SamplingParams(n=16, max_new_tokens=64, temperature=1.5, seed=7))
    assert set(out.finish_reasons) == {"stop", "length"}
    for ids, reason in zip(out.response_ids, out.finish_reasons):
        if reason == "stop":
            assert ids[-1] == eos and eos not in ids[:-1]
        else:
            assert len(ids) == 64 and eos not in ids


@pytest.mark.slow
@pytest.mark.vllm
def test_stop_strings_and_per_prompt_budgets(engine, tokenizer):
    """As the HF engine: a row ends with the token that completes its first stop string (text included), at
    EOS or at its own budget, and what it drew before the stop is the unstopped sample of the same seed."""
    prompts, stop, budgets = [tokenizer.encode("go"), tokenizer.encode("xy")], ("e", "42"), [7, 30]
    out = engine.generate(prompts, SamplingParams(n=8, max_new_tokens=30, seed=4, stop=stop), max_new_tokens=budgets)
    free = engine.generate(prompts, SamplingParams(n=8, max_new_tokens=30, seed=4))
    stopped = 0
    for row, (ids, text, reason) in enumerate(zip(out.response_ids, out.texts, out.finish_reasons)):
        assert 1 <= len(ids) <= budgets[row // 8]
        assert free.response_ids[row][: len(ids)] == ids
        texts = [tokenizer.decode(ids[:t], skip_special_tokens=True) for t in range(1, len(ids) + 1)]
        first_hit = next((t + 1 for t, prefix in enumerate(texts) if any(s in prefix for s in stop)), None)
        if first_hit is not None:
            assert first_hit == len(ids) and reason == "stop" and text == texts[-1]
            stopped += 1
    assert stopped > 0


@pytest.mark.slow
@pytest.mark.vllm
def test_same_seed_same_rollouts_and_training_rng_untouched(engine, tokenizer):
    prompts = [tokenizer.encode("ab"), tokenizer.encode("cd")]
    params = SamplingParams(n=3, max_new_tokens=12, seed=5)
    before = torch.get_rng_state()
    a = engine.generate(prompts, params)
    assert torch.equal(before, torch.get_rng_state())
    b = engine.generate(prompts, params)
    c = engine.generate(prompts, SamplingParams(n=3, max_new_tokens=12, seed=6))
    assert a.response_ids == b.response_ids and a.response_logprobs == b.response_logprobs
    assert a.response_ids != c.response_ids
    # The same prompt twice in one call must not get the same samples.
    d = engine.generate([prompts[0], prompts[0]], params)
    assert d.response_ids[:3] != d.response_ids[3:]


@pytest.mark.slow
@pytest.mark.vllm
def test_a_prompts_samples_do_not_depend_on_its_batch(engine, tokenizer):
    """Per-prompt seeds: the same samples alone or among other prompts (what makes sharding invisible)."""
    params = SamplingParams(n=3, max_new_tokens=12, temperature=1.2)
    prompt, others = tokenizer.encode("ab"), [tokenizer.encode("the longer prompt"), tokenizer.encode("x")]
    alone = engine.generate([prompt], params, seeds=[4321])
    crowded = engine.generate([others[0], prompt, others[1]], params, seeds=[8, 4321, 77])
    assert crowded.response_ids[3:6] == alone.response_ids
    assert crowded.response_ids[:3] != alone.response_ids
    shifted = engine.generate([prompt], params, seeds=[4322])
    assert shifted.response_ids[0] == alone.response_ids[1], "sample j of seed s is drawn from stream s + j"


@pytest.mark.slow
@pytest.mark.vllm
def test_sleep_and_wake_keep_weights(engine, tokenizer):
    params = SamplingParams(n=2, max_new_tokens=8, seed=1)
    a = engine.generate([tokenizer.encode("zz")], params)
    engine.sleep()
    engine.wake()
    engine.sleep()
    b = engine.generate([tokenizer.encode("zz")], params)  # generate wakes a sleeping engine
    assert a.response_ids == b.response_ids


@pytest.mark.slow
@pytest.mark.vllm
def test_agrees_with_hf_in_distribution(engine, tokenizer, policy):
    from stare_lightning.rollout.hf import HFRolloutEngine

    prompt = [tokenizer.encode("q")]
    params = SamplingParams(n=400, max_new_tokens=1, temperature=0.1, seed=0)
    with torch.no_grad():
        probs = torch.softmax(policy(torch.tensor(prompt)).logits[0, -1] / 0.1, -1)
    for out in (engine.generate(prompt, params), HFRolloutEngine(policy, tokenizer).generate(prompt, params)):
        counts = torch.bincount(torch.tensor([r[0] for r in out.response_ids]), minlength=probs.numel())
        total_variation = 0.5 * (counts / counts.sum() - probs).abs().sum().item()
        assert total_variation < 0.15


@pytest.mark.slow
@pytest.mark.vllm
def test_sync_weights_after_training(engine, tokenizer, policy):
    """After a few large optimizer steps the engine only matches the trainer once weights are synced."""
    original = copy.deepcopy(policy)
    _train_a_little(policy, tokenizer)
    prompt = [tokenizer.encode("the answer is")]
    params = SamplingParams(n=4, max_new_tokens=12, seed=3)
    try:
        stale = engine.generate(prompt, params)
        assert _max_abs_diff(policy, stale) > 0.5, "without a sync the engine must still hold the old weights"
        engine.sync_weights(policy)
        assert engine.last_sync_seconds > 0
        synced = engine.generate(prompt, params)
        assert _max_abs_diff(policy, synced) < 1e-3
        assert synced.response_ids != stale.response_ids  # it samples from the new policy
    finally:
        engine.sync_weights(original)  # leave the shared engine as the other tests expect it
    assert _max_abs_diff(original, engine.generate(prompt, params)) < 1e-4


@pytest.mark.slow
@pytest.mark.vllm
def test_bf16_engine_follows_an_fp32_trainer(tiny_dir, tokenizer, policy):
    """The GPU recipe's pairing: fp32 master weights synced into an engine that computes in bf16."""
    from stare_lightning.rollout.vllm import VLLMRolloutEngine

    _train_a_little(policy, tokenizer)
    prompt, params = [tokenizer.encode("the answer is")], SamplingParams(n=8, max_new_tokens=12, seed=3)
    engine = VLLMRolloutEngine(tiny_dir, dtype="bfloat16", max_model_len=256, kv_cache_memory_bytes=64 << 20)
    try:
        assert _max_abs_diff(policy, engine.generate(prompt, params)) > 0.5
        engine.sync_weights(policy)  # fp32 tensors into bf16 parameters
        synced = engine.generate(prompt, params)
    finally:
        engine.close()
    diffs = [
        (_trainer_logprobs(policy, p, r) - torch.tensor(lps)).abs()
        for p, r, lps in zip(synced.prompt_ids, synced.response_ids, synced.response_logprobs)
    ]
    diffs = torch.cat(diffs)
    # bf16 rounding of weights and activations: a few 1e-2 at most, far from the stale engine's > 0.5.
    assert diffs.mean() < 0.015 and diffs.max() < 0.08, (
        float(diffs.mean()),
        float(diffs.max()),
    )  # 0.004, 0.009 measured
    assert diffs.max() > 1e-4, "identical to fp32: the engine did not run in bf16"


def _long_prompts(tokenizer, count: int) -> list[list[int]]:
    return [tokenizer.encode(f"prompt number {i}: " + "abcdefghij" * 6) for i in range(count)]


@pytest.mark.slow
@pytest.mark.vllm
def test_a_batch_over_one_prefill_step_keeps_its_seeded_samples(engine, tiny_dir, tokenizer, policy):
    """Reported crash: 8 prompts x 8 samples x ~80 tokens exceed one step's token budget (4096 on CPU), vLLM's
    chunked prefill splits a seeded prompt and rewinds its CPU generator ("CPU Generator does not use offset").
    With the CPU default (chunked prefill off) the batch takes several prefill steps and each prompt gets the
    samples it gets in a batch that fits one step."""
    from stare_lightning.rollout.config import RolloutConfig
    from stare_lightning.rollout.factory import build_engine

    if not engine.on_cpu:
        pytest.skip("CPU defaults under test; on GPU vLLM's chunked prefill rewinds CUDA generators")
    prompts, seeds = _long_prompts(tokenizer, 8), [1000 * i + 7 for i in range(8)]
    params = SamplingParams(n=8, max_new_tokens=4)
    scheduler = engine.llm.llm_engine.vllm_config.scheduler_config
    assert scheduler.enable_chunked_prefill is False
    assert sum(map(len, prompts)) * params.n > scheduler.max_num_batched_tokens > 2 * len(prompts[0]) * params.n
    crowded = engine.generate(prompts, params, seeds=seeds)
    pairs = [engine.generate(prompts[i : i + 2], params, seeds=seeds[i : i + 2]) for i in range(0, 8, 2)]
    assert crowded.response_ids == [ids for pair in pairs for ids in pair.response_ids]

    # The old settings (vLLM's default, chunked prefill on) through rollout.engine_kwargs: the batch that fits
    # one step samples the same; the large one crashes.
    cfg = RolloutConfig(
        backend="vllm",
        engine_kwargs={"enable_chunked_prefill": True, "max_model_len": 256, "kv_cache_memory_bytes": 64 << 20},
    )
    old = build_engine(cfg, policy, tokenizer, str(tiny_dir))
    try:
        assert old.generate(prompts[:2], params, seeds=seeds[:2]).response_ids == pairs[0].response_ids
        with pytest.raises(RuntimeError, match="CPU Generator does not use offset") as info:
            old.generate(prompts, params, seeds=seeds)
        assert "rollout.engine_kwargs" in str(info.value)
    finally:
        old.close()


@pytest.mark.vllm
def test_engine_kwargs_are_checked_against_vllm_before_the_engine_starts(tiny_dir, tokenizer):
    from stare_lightning.rollout.config import RolloutConfig
    from stare_lightning.rollout.factory import build_engine
    from stare_lightning.rollout.vllm import check_engine_kwargs

    check_engine_kwargs({"max_num_seqs": 8, "max_num_batched_tokens": 512, "max_model_len": 128})
    with pytest.raises(ValueError) as info:  # no policy and no model: it fails before either is needed
        build_engine(RolloutConfig(engine_kwargs={"max_num_batched_token": 512}), None, tokenizer, str(tiny_dir))
    message = str(info.value)
    assert message.startswith("rollout.engine_kwargs.max_num_batched_token is not allowed")
    assert "did you mean max_num_batched_tokens" in message and "allowed keys include" in message
    with pytest.raises(ValueError, match=r"rollout\.engine_kwargs\.seed .*use seed"):
        check_engine_kwargs({"seed": 3})


@pytest.mark.parametrize(
    "key,instead",
    [
        ("model", "model.name_or_path"),
        ("tokenizer", "model.name_or_path"),
        ("dtype", "trainer.precision"),
        ("seed", "use seed"),
        ("enable_sleep_mode", "rollout.enable_sleep_mode"),
        ("tensor_parallel_size", "rollout.tensor_parallel_size"),
        ("logprobs_mode", "processed_logprobs"),
        ("max_loras", "rollout.lora_sync"),
    ],
)
def test_engine_kwargs_refuse_what_the_project_sets(key, instead):
    from stare_lightning.rollout.config import RolloutConfig

    with pytest.raises(ValueError, match=rf"rollout\.engine_kwargs\.{key} is not allowed: the project sets it") as info:
        RolloutConfig(engine_kwargs={key: 1})
    assert instead in str(info.value)


def test_engine_kwargs_must_be_a_mapping_and_are_refused_with_hf(tmp_path):
    from stare_lightning.cli import compose, prepare_config
    from stare_lightning.rollout.config import RolloutConfig

    with pytest.raises(ValueError, match="rollout.engine_kwargs=.* must be a mapping"):
        RolloutConfig(engine_kwargs=["max_num_seqs"])
    with pytest.raises(ValueError, match="not allowed with rollout.backend=hf: .* would do nothing"):
        RolloutConfig(backend="hf", engine_kwargs={"max_num_seqs": 8})
    assert RolloutConfig(backend="hf").engine_kwargs == {}
    _, run = prepare_config(compose([f"output_dir={tmp_path}", "+rollout.engine_kwargs.max_num_seqs=64"]))
    assert run.rollout.engine_kwargs == {"max_num_seqs": 64} and type(run.rollout.engine_kwargs) is dict


def _sharded_worker(rank: int, world: int, tiny_dir: str):
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from stare_lightning.rollout.vllm import VLLMRolloutEngine
    from stare_lightning.rollout.weights import iter_full_weights

    tok = AutoTokenizer.from_pretrained(tiny_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    engine = VLLMRolloutEngine(tiny_dir, max_model_len=64, kv_cache_memory_bytes=16 << 20)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batch = torch.tensor([tok.encode(f"rank {rank} data")])
    for _ in range(2):
        model(batch, labels=batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    engine.sync_weights(model)  # all-gathers every parameter, same order on both ranks
    full = {name: t.clone() for name, t in iter_full_weights(model)}
    out = engine.generate([tok.encode(f"r{rank}")], SamplingParams(n=2, max_new_tokens=10, seed=rank))
    engine.close()
    dist.barrier()  # the trainer's process group survives the engine
    return {"state": full if rank == 0 else None, "rollouts": (out.prompt_ids, out.response_ids, out.response_logprobs)}


@pytest.mark.slow
@pytest.mark.vllm
def test_fsdp2_sync_on_two_ranks(tiny_dir, tmp_path):
    """Each rank of a 2-process FSDP2 trainer owns an engine; sync gathers DTensors and leaves the group intact."""
    from transformers import AutoModelForCausalLM

    # Spawned: this process may hold the module's engine, and a fork would copy it, its threads' locks included.
    results = run_on_ranks(_sharded_worker, tmp_path, str(tiny_dir), start_method="spawn")
    trained = AutoModelForCausalLM.from_pretrained(tiny_dir).eval()
    trained.load_state_dict(results[0]["state"])
    for rank in (0, 1):
        prompts, responses, logprobs = results[rank]["rollouts"]
        for prompt, resp, lps in zip(prompts, responses, logprobs):
            torch.testing.assert_close(torch.tensor(lps), _trainer_logprobs(trained, prompt, resp), atol=1e-3, rtol=0)
