"""LoRA through peft: the merged weights are the adapted model's, only the adapters train in a real fit, the
rollout engine receives merged weights (the log-prob canary says so, and would not with the base weights), a
checkpoint holds the adapters without the frozen base, resumes and exports to a plain HF directory (and refuses
another base), and the config refuses what cannot work."""

from __future__ import annotations

import shutil
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from stare_lightning.models.config import LORA_TARGETS, LoraConfig, ModelConfig
from stare_lightning.models.lora import PEFT_PREFIX, apply_lora, as_wrapped, merge_adapters
from stare_lightning.rollout.canary import MAX_KEY, MEAN_KEY, LogprobCanary
from stare_lightning.rollout.config import RolloutConfig
from stare_lightning.rollout.weights import iter_full_weights
from tests.needs import require
from tests.test_config import compose_run as compose_config
from tests.test_fit import FAST, compose_run, read_metrics, run_cli, train_rows

require("peft")

IDS = torch.tensor([[5, 17, 3, 42, 8, 19, 23, 4, 11, 30, 2, 9], [7, 7, 2, 9, 41, 16, 5, 28, 3, 12, 60, 1]])
THRESHOLD = RolloutConfig().canary_threshold  # the default rollout.canary_threshold
# A LoRA run on the tiny model with a learning rate at which the adapters move in a few steps.
LORA = ["model.lora.rank=4", "optim.lr=1e-2", "validation.before_fit=false", "trainer.val_check_interval=100"]
KL = ["algorithm.kl.coef=0.05"]  # a KL term: its reference is the policy with the adapters off


def _plain(model_dir, state: dict | None = None) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if state is not None:
        model.load_state_dict(state, strict=True)
    return model


def _adapted(model_dir, rank: int = 4) -> torch.nn.Module:
    return apply_lora(_plain(model_dir), LoraConfig(rank=rank))


def _logprobs(model: torch.nn.Module, ids: torch.Tensor = IDS) -> torch.Tensor:
    """Each next token's log-prob under ``model`` (what the trainer and the canary compare)."""
    with torch.no_grad():
        logits = model(input_ids=ids).logits[:, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)


def _train_adapters(model: torch.nn.Module, steps: int = 4, lr: float = 1e-2) -> None:
    """A few large AdamW steps on one batch: the adapters move far beyond kernel noise."""
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    for _ in range(steps):
        model(input_ids=IDS, labels=IDS).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()


def _base_name(peft_name: str) -> str:
    return peft_name.removeprefix(PEFT_PREFIX).replace(".base_layer.", ".")


# ------------------------------------------------------------------------------------------- the merge
def test_merged_weights_compute_what_the_adapted_model_computes(tiny_dir):
    policy = _adapted(tiny_dir)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # peft starts B at zero (no change at all): give every adapter a real update
        for name, param in policy.named_parameters():
            if ".lora_B." in name:
                param.copy_(0.05 * torch.randn(param.shape, generator=generator))
    trained = {name: p.detach().clone() for name, p in policy.named_parameters()}
    merged = dict(iter_full_weights(policy))

    base = _plain(tiny_dir)
    assert list(merged) == [name for name, _ in base.named_parameters()]  # the base's names and order, no lora_*
    reference = _plain(tiny_dir, merged)
    ids = torch.randint(0, base.config.vocab_size, (3, 20), generator=generator)
    with torch.no_grad():
        want = policy(input_ids=ids).logits
        assert torch.allclose(reference(input_ids=ids).logits, want, atol=1e-5, rtol=0)
        assert (base(input_ids=ids).logits - want).abs().max() > 1e-2  # the adapters do change the output
    # The trainer's module is read, never merged in place.
    assert all(torch.equal(p, trained[name]) for name, p in policy.named_parameters())
    assert all(".lora_A." in name or ".lora_B." in name for name, p in policy.named_parameters() if p.requires_grad)


def test_base_weights_instead_of_merged_ones_would_trip_the_canary(tiny_dir):
    """What a sync of the unmerged base weights would look like to the canary, once the adapters have moved."""
    policy = _adapted(tiny_dir)
    _train_adapters(policy)
    trainer_logprobs = _logprobs(policy)
    canary = LogprobCanary(threshold=THRESHOLD, sync_dist=False)
    merged = canary.update(_logprobs(_plain(tiny_dir, dict(iter_full_weights(policy)))), trainer_logprobs)
    unmerged = canary.update(_logprobs(_plain(tiny_dir)), trainer_logprobs)
    assert merged[MAX_KEY] < 1e-5
    assert unmerged[MEAN_KEY] > THRESHOLD, unmerged


@pytest.mark.slow
@pytest.mark.vllm
def test_vllm_engine_synced_from_a_lora_policy_samples_from_it(tiny_dir):
    from stare_lightning.rollout.base import SamplingParams
    from stare_lightning.rollout.vllm import VLLMRolloutEngine

    policy = _adapted(tiny_dir)
    _train_adapters(policy)
    engine = VLLMRolloutEngine(str(tiny_dir), max_model_len=64, kv_cache_memory_bytes=16 << 20)
    try:
        params, prompts = SamplingParams(n=4, max_new_tokens=12, seed=3), [IDS[0, :4].tolist(), IDS[1, :4].tolist()]
        stale = engine.generate(prompts, params)  # the engine as built: the base model's weights
        engine.sync_weights(policy)
        synced = engine.generate(prompts, params)
    finally:
        engine.close()
    canary = LogprobCanary(threshold=THRESHOLD, sync_dist=False)
    for rollouts, agrees in ((synced, True), (stale, False)):
        ids = [torch.tensor(p + r) for p, r in zip(rollouts.prompt_ids, rollouts.response_ids)]
        trainer = torch.cat([_logprobs(policy, row[None])[0, len(p) - 1 :] for row, p in zip(ids, rollouts.prompt_ids)])
        engine_lps = torch.tensor([lp for row in rollouts.response_logprobs for lp in row])
        metrics = canary.update(engine_lps, trainer)
        assert (metrics[MAX_KEY] < 1e-4) if agrees else (metrics[MEAN_KEY] > THRESHOLD), metrics


def test_merge_accepts_any_order_and_refuses_what_it_cannot_merge(tiny_dir):
    policy = _adapted(tiny_dir)
    state = {name: p.detach() for name, p in policy.named_parameters()}
    forward = dict(merge_adapters(state.items(), 2.0))
    backward = dict(merge_adapters(reversed(list(state.items())), 2.0))
    assert forward.keys() == backward.keys() and all(torch.equal(forward[k], backward[k]) for k in forward)
    name = next(n for n in state if ".lora_B." in n)
    with pytest.raises(ValueError, match="without all of base weight, A and B"):
        list(merge_adapters([(k, v) for k, v in state.items() if k != name], 2.0))
    with pytest.raises(ValueError, match="only adapter 'default'"):
        list(merge_adapters([(name.replace(".default.", ".other."), state[name])], 2.0))


def test_only_the_adapters_train_and_reach_the_optimizer(tiny_dir):
    from stare_lightning.trainer import OptimConfig, build_optimizer

    policy = _adapted(tiny_dir, rank=2)
    trainable = [p for p in policy.parameters() if p.requires_grad]
    assert len(trainable) == 2 * len(LORA_TARGETS) * policy.config.num_hidden_layers
    optimizer, _ = build_optimizer(policy.parameters(), OptimConfig(), total_steps=1)
    assert [p for group in optimizer.param_groups for p in group["params"]] == trainable


# ------------------------------------------------------------------------------------- the reference
def test_the_policy_with_its_adapters_off_scores_as_a_separately_loaded_base(tiny_dir):
    from stare_lightning.models.loading import load_reference
    from stare_lightning.models.reference import ReferencePolicy

    policy = apply_lora(_plain(tiny_dir), LoraConfig(rank=4, dropout=0.3))
    _train_adapters(policy)
    policy.train()  # as in a step: LoRA dropout on, which the reference forward must not see
    reference = ReferencePolicy.of(policy, None)
    with reference.scoring() as model:
        off, again = _logprobs(model), _logprobs(model)
    assert policy.training  # back in the mode the step left it in
    base = _logprobs(load_reference(tiny_dir, ModelConfig(dtype="float32")))
    assert torch.allclose(off, base, atol=1e-6, rtol=0) and torch.equal(off, again)
    # The adapters are on again after the context, and they matter: the check above could have failed.
    assert (_logprobs(policy.eval()) - base).abs().max() > 1e-2


def test_a_lora_policy_is_its_own_reference_and_a_full_one_needs_its_copy(tiny_dir):
    from stare_lightning.models.reference import ReferencePolicy

    plain = _plain(tiny_dir)
    with pytest.raises(ValueError, match="takes no frozen copy"):
        ReferencePolicy.of(_adapted(tiny_dir), plain)
    with pytest.raises(ValueError, match="needs a frozen copy"):
        ReferencePolicy.of(_plain(tiny_dir), None)
    assert ReferencePolicy.of(_plain(tiny_dir), plain) == ReferencePolicy(plain, adapters_off=False)


def test_gradient_checkpointing_still_reaches_the_adapters(tiny_dir):
    """Reentrant checkpointing with frozen embeddings (transformers 4.x's default; 5.x makes the inputs need
    gradients itself, so there this guards against a regression rather than showing the fix)."""
    model = _plain(tiny_dir)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    policy = apply_lora(model, LoraConfig(rank=2))
    policy.train()
    policy(input_ids=IDS, labels=IDS).loss.backward()
    # B starts at zero, so A's first gradient is zero too; B's is not.
    grads = {n: p.grad for n, p in policy.named_parameters() if ".lora_B." in n}
    assert all(g is not None and g.abs().sum() > 0 for g in grads.values()), [n for n, g in grads.items() if g is None]


def test_export_of_a_lora_checkpoint_is_a_plain_model_with_merged_weights(tiny_dir, tmp_path):
    from stare_lightning.models.export import export_checkpoint

    policy = _adapted(tiny_dir)
    _train_adapters(policy, steps=2)
    model_cfg = ModelConfig(lora=LoraConfig(rank=4))
    checkpoint = {
        "state_dict": {f"policy.{k}": v for k, v in policy.state_dict().items()},
        "hyper_parameters": {"model_dir": str(tiny_dir), "model": asdict(model_cfg)},
    }
    torch.save(checkpoint, tmp_path / "lora.ckpt")
    exported = _plain(export_checkpoint(tmp_path / "lora.ckpt", tmp_path / "hf"))
    assert torch.allclose(_logprobs(exported), _logprobs(policy), atol=1e-5, rtol=0)
    del checkpoint["hyper_parameters"]["model"]
    torch.save(checkpoint, tmp_path / "no_settings.ckpt")
    with pytest.raises(ValueError, match="no model.lora settings"):
        export_checkpoint(tmp_path / "no_settings.ckpt", tmp_path / "hf2")


def _trainable(policy: torch.nn.Module) -> set[str]:
    return {name for name, p in policy.named_parameters() if p.requires_grad}


def test_the_base_named_as_peft_wraps_it_is_the_wrapped_policys_frozen_state(tiny_dir):
    policy = _adapted(tiny_dir, rank=2)
    adapted = {name.split(".lora_A.")[0] for name in _trainable(policy) if ".lora_A." in name}
    renamed = dict(as_wrapped(_plain(tiny_dir).state_dict().items(), adapted))
    frozen = {k: v for k, v in policy.state_dict().items() if k not in _trainable(policy)}
    assert renamed.keys() == frozen.keys()
    assert all(torch.equal(renamed[k], frozen[k]) for k in frozen)


def test_an_adapter_only_checkpoint_resumes_and_exports_from_its_base_and_refuses_another(tiny_dir, tmp_path):
    from stare_lightning.models.export import export_checkpoint
    from stare_lightning.models.tiny import build_tiny_model
    from stare_lightning.trainer.frozen_base import omit_frozen_base, restore_frozen_base

    policy = _adapted(tiny_dir)
    _train_adapters(policy, steps=2)
    state = {f"policy.{k}": v for k, v in policy.state_dict().items()}
    model = asdict(ModelConfig(lora=LoraConfig(rank=4)))
    checkpoint = {"state_dict": state, "hyper_parameters": {"model_dir": str(tiny_dir), "model": model}}
    omit_frozen_base(checkpoint, policy, "policy.", str(tiny_dir))
    assert {k.removeprefix("policy.") for k in checkpoint["state_dict"]} == _trainable(policy)

    # A resume gets the loaded base back into the state dict, and a strict load of it restores the trained policy.
    fresh = _adapted(tiny_dir)
    resumed = {"state_dict": dict(checkpoint["state_dict"]), "stare_lightning": checkpoint["stare_lightning"]}
    restore_frozen_base(resumed, fresh, "policy.", str(tiny_dir), "adapters.ckpt")
    fresh.load_state_dict({k.removeprefix("policy."): v for k, v in resumed["state_dict"].items()}, strict=True)
    assert torch.equal(_logprobs(fresh.eval()), _logprobs(policy.eval()))

    # The base is named by its files, not its path: a copy serves; another model of the same shape does not.
    copy, other = tmp_path / "copy", build_tiny_model(tmp_path / "other", seed=1)
    shutil.copytree(tiny_dir, copy)
    for model_dir in (tiny_dir, copy):
        checkpoint["hyper_parameters"]["model_dir"] = str(model_dir)
        torch.save(checkpoint, tmp_path / "adapters.ckpt")
        exported = _plain(export_checkpoint(tmp_path / "adapters.ckpt", tmp_path / "hf"))
        assert torch.allclose(_logprobs(exported), _logprobs(policy), atol=1e-5, rtol=0)
    checkpoint["hyper_parameters"]["model_dir"] = str(other)
    torch.save(checkpoint, tmp_path / "adapters.ckpt")
    with pytest.raises(ValueError, match=f"the model at {other} is not that model"):
        export_checkpoint(tmp_path / "adapters.ckpt", tmp_path / "hf2")
    with pytest.raises(ValueError, match="adapters.ckpt holds LoRA adapters without their frozen base"):
        restore_frozen_base(resumed, fresh, "policy.", str(other), "adapters.ckpt")

    # Fields a crafted checkpoint could bend are checked before they are used, and named.
    checkpoint["hyper_parameters"]["model_dir"] = str(tiny_dir)
    checkpoint["hyper_parameters"]["model"]["dtype"] = "load"  # a torch attribute, not a dtype
    torch.save(checkpoint, tmp_path / "adapters.ckpt")
    with pytest.raises(ValueError, match="hyper_parameters.model.dtype.*load"):
        export_checkpoint(tmp_path / "adapters.ckpt", tmp_path / "hf3")
    resumed["stare_lightning"] = {"frozen_base": {"model_dir": str(tiny_dir), "fingerprint": ["not", "a", "digest"]}}
    with pytest.raises(ValueError, match="adapters.ckpt: stare_lightning.frozen_base must map model_dir and"):
        restore_frozen_base(resumed, fresh, "policy.", str(tiny_dir), "adapters.ckpt")


# ------------------------------------------------------------------------------------------- the config
def test_lora_config_composes_from_the_command_line(tmp_path):
    _, run = compose_config(tmp_path, ["model.lora.rank=8"])
    assert run.model.lora == LoraConfig(rank=8) and run.model.lora.scaling == 2.0
    assert run.model.cold_start is not None  # with the tiny model's cold start: fine
    _, run = compose_config(tmp_path, ["model.lora.rank=8", "model.lora.alpha=4", "model.lora.target_modules=[q_proj]"])
    assert run.model.lora.scaling == 0.5 and run.model.lora.target_modules == ["q_proj"]
    for sharded_or_not in ("trainer=ddp", "trainer=fsdp"):  # FSDP2 shards the peft-wrapped policy too
        _, run = compose_config(tmp_path, ["model.lora.rank=8", sharded_or_not])
        assert run.model.lora.rank == 8
    for off in ([], ["model.lora=null"]):
        assert compose_config(tmp_path, off)[1].model.lora is None


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["model.lora.alpha=32"], "model.lora.alpha=32.0 does nothing with model.lora.rank=0"),
        (["model.lora.target_modules=[q_proj]"], "model.lora.target_modules=['q_proj'] does nothing"),
        (["model.lora.rank=-1"], "model.lora.rank=-1 is out of range"),
        (["model.lora.rank=4", "model.lora.dropout=1.0"], r"model.lora.dropout=1.0 is out of range"),
        (["model.lora.rank=4", "model.lora.alpha=0"], "model.lora.alpha=0.0 is out of range"),
        (["model.lora.rank=4", "model.lora.target_modules=[]"], "model.lora.target_modules=[] is not allowed"),
    ],
)
def test_lora_settings_that_would_break_or_do_nothing_are_refused(tmp_path, overrides, message):
    with pytest.raises(ValueError) as info:
        compose_config(tmp_path, overrides)
    assert message in str(info.value)


def test_a_target_module_the_model_lacks_names_the_key(tiny_dir):
    with pytest.raises(ValueError, match=r"model\.lora\.target_modules=\['qkv_proj'\]"):
        apply_lora(_plain(tiny_dir), LoraConfig(rank=2, target_modules=["qkv_proj"]))


# ------------------------------------------------------------------------------------------- real fits
def _base_weights_unchanged(policy: torch.nn.Module, model_dir: str) -> list[str]:
    """The policy's frozen parameters that differ from the model directory's weights (none, bit for bit)."""
    base = load_file(Path(model_dir) / "model.safetensors")
    frozen = [(name, p) for name, p in policy.named_parameters() if not p.requires_grad]
    assert len(frozen) == len(base)
    return [name for name, p in frozen if not torch.equal(p.detach(), base[_base_name(name)])]


@pytest.mark.slow
def test_lora_fit_trains_only_the_adapters_resumes_and_exports(tmp_path, model_cache):
    from stare_lightning import train
    from stare_lightning.models.export import export_checkpoint

    cfg = compose_run(tmp_path / "run", [*LORA, *KL, "trainer.max_steps=2"])
    module, datamodule = train._setup(cfg)
    module.configure_model()
    assert module.reference is None  # the KL term reads the policy with its adapters off, not a second model
    start = {name: p.detach().clone() for name, p in module.policy.named_parameters() if p.requires_grad}
    train.build_trainer(cfg).fit(module, datamodule=datamodule)
    assert not _base_weights_unchanged(module.policy, module.model_dir)
    moved = [name for name, p in module.policy.named_parameters() if name in start and not torch.equal(p, start[name])]
    assert len(moved) == len(start), f"adapters that did not move: {sorted(set(start) - set(moved))}"

    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    state = torch.load(last, map_location="cpu", weights_only=False)["state_dict"]
    policy_keys = {key.removeprefix("policy.") for key in state if key.startswith("policy.")}
    assert policy_keys == _trainable(module.policy), "the checkpoint should hold the adapters and no frozen base"
    assert not any(key.startswith("reference.") for key in state)
    # The adapters start at B = 0, so step 0's policy is its reference (KL 0); once they moved, it is not.
    kl = {step: row["train/kl"] for step, row in train_rows(read_metrics(tmp_path / "run")).items()}
    assert abs(kl[0]) < 1e-6 and kl[1] > 1e-6, kl
    exported = _plain(export_checkpoint(last, tmp_path / "hf"))
    assert torch.allclose(_logprobs(exported), _logprobs(module.policy.eval()), atol=1e-5, rtol=0)

    # Resume: configure_model wraps the policy again, so the checkpoint's peft names load as they were saved.
    cfg = compose_run(tmp_path / "run", [*LORA, *KL, "trainer.max_steps=3"])
    resumed, datamodule = train._setup(cfg)
    trainer = train.build_trainer(cfg)
    trainer.fit(resumed, datamodule=datamodule, ckpt_path=str(last))
    assert trainer.global_step == 3 and sorted(train_rows(read_metrics(tmp_path / "run"))) == [0, 1, 2]
    assert not _base_weights_unchanged(resumed.policy, resumed.model_dir)


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.parametrize(
    "engine",
    # adapter-only sync, colocated and served (on a CPU auto would sync merged weights: rollout/factory.py)
    [["rollout=vllm", "rollout.lora_sync=adapter"], ["rollout=server", "rollout.lora_sync=adapter"]],
    ids=["colocated", "server"],
)
def test_lora_fit_with_vllm_rollouts_keeps_the_canary_quiet(tmp_path, model_cache, engine):
    from stare_lightning.models.export import export_checkpoint

    args = ["fit", f"output_dir={tmp_path}", *FAST, *LORA, *engine, "trainer.max_steps=4"]
    proc = run_cli(args, model_cache, cwd=tmp_path)
    out, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, out[-4000:]
    steps = train_rows(read_metrics(tmp_path))
    assert sorted(steps) == [0, 1, 2, 3]
    # Steps 1-3 sample from weights synced after an update: the engine's log-probs are the LoRA policy's.
    worst = {step: row["train/rollout/logprob_abs_diff/max"] for step, row in steps.items()}
    assert all(value < THRESHOLD for value in worst.values()), worst

    # The check discriminates: by the end the adapters moved the policy far enough that an engine holding the
    # base weights (a sync that dropped the adapters) would differ from the trainer by more than the threshold.
    checkpoint = tmp_path / "checkpoints" / "last.ckpt"
    model_dir = torch.load(checkpoint, map_location="cpu", weights_only=False)["hyper_parameters"]["model_dir"]
    merged = _plain(export_checkpoint(checkpoint, tmp_path / "hf"))
    canary = LogprobCanary(threshold=THRESHOLD, sync_dist=False)
    assert canary.update(_logprobs(_plain(model_dir)), _logprobs(merged))[MEAN_KEY] > THRESHOLD
