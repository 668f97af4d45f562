"""LoRA under FSDP2: the peft-wrapped policy sharded over two gloo ranks trains as one process does.

Two levels. On the sharding itself (no Lightning): two ranks, each with half of a fixed batch, take the same two
optimizer steps as one process with the whole batch (losses, gradient norms, adapters, the merged weights or the
adapters alone that a rollout engine would receive, the KL reference with the adapters off, and what the HF
engine samples from the sharded module), while only the adapters get gradients and optimizer state and the frozen
base stays bit for bit the model directory's. On a real
``fit`` with ``trainer=fsdp`` on two processes: a run resumed from its step-1 distributed checkpoint ends where
the uninterrupted run ends, its KL term measures against the sharded policy with its adapters off (no second
model), its checkpoint keeps optimizer state for the adapters only, and ``export`` gives a plain HF model whose
weights are peft's own merge of the checkpoint's adapters into the base.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from stare_lightning.models.config import LoraConfig, ModelConfig
from stare_lightning.models.lora import PEFT_PREFIX
from tests.distributed import run_on_ranks
from tests.needs import require
from tests.test_fit import read_metrics, run_cli, train_rows
from tests.test_fsdp import _fit

require("peft")

pytestmark = pytest.mark.slow

STEPS = 2
# A fixed global batch of equal-length rows: each of two ranks' mean loss then weighs its tokens as the whole
# batch's mean does, so FSDP2's averaged gradient is the one-process gradient.
IDS = torch.randint(4, 100, (4, 16), generator=torch.Generator().manual_seed(0))
# Two ranks sum in another order than one process (about 1e-7 relative); Adam divides each element by its own
# second moment, which lifts that to about 5e-7 on the adapters after two steps.
ATOL = 5e-6
TEMPERATURE = 1.0


def _lora_policy(model_dir: str) -> torch.nn.Module:
    """The run's policy loader with LoRA and gradient checkpointing, every adapter set from one seeded generator:
    peft draws A from the process's own random state, and starts B at zero (A would get no first gradient)."""
    from stare_lightning.models.loading import load_policy

    policy = load_policy(model_dir, ModelConfig(lora=LoraConfig(rank=4), gradient_checkpointing=True))
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in policy.parameters():
            if param.requires_grad:
                param.copy_(0.05 * torch.randn(param.shape, generator=generator))
    return policy.train()


def _train(policy: torch.nn.Module, rows: torch.Tensor) -> dict:
    """``STEPS`` AdamW steps through the project's optimizer and clipping; the loss is averaged over ranks."""
    from stare_lightning import distributed
    from stare_lightning.trainer import OptimConfig, build_optimizer
    from stare_lightning.trainer.optim import clip_and_step

    optimizer, scheduler = build_optimizer(policy.parameters(), OptimConfig(lr=1e-2), total_steps=STEPS)
    losses, norms = [], []
    for step in range(STEPS):
        loss = policy(input_ids=rows, labels=rows).loss
        loss.backward()
        if step == 0:
            with_grad = sorted(name for name, p in policy.named_parameters() if p.grad is not None)
        losses.append(float(distributed.all_reduce(loss.detach())) / distributed.world_size())
        norms.append(clip_and_step(optimizer, scheduler, policy, grad_clip=1.0, finite=True))
    with_state = sorted(name for name, p in policy.named_parameters() if optimizer.state.get(p))
    return {"losses": losses, "norms": norms, "with_grad": with_grad, "with_state": with_state}


def _sample(policy: torch.nn.Module, model_dir: str, prompt: list[int]):
    """What the HF rollout engine samples from ``policy`` (the trainer's module, sharded or not)."""
    from transformers import AutoTokenizer

    from stare_lightning.rollout.base import SamplingParams
    from stare_lightning.rollout.hf import HFRolloutEngine

    engine = HFRolloutEngine(policy, AutoTokenizer.from_pretrained(model_dir))
    out = engine.generate([prompt], SamplingParams(n=2, max_new_tokens=8, temperature=TEMPERATURE, seed=3))
    return list(zip(out.prompt_ids, out.response_ids, out.response_logprobs))


def _sharded_worker(rank: int, world: int, model_dir: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from stare_lightning.models.reference import ReferencePolicy
    from stare_lightning.models.sharding import shard_model
    from stare_lightning.rollout.adapters import adapter_weights
    from stare_lightning.rollout.weights import full_tensor, iter_full_weights

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("data_parallel",))
    policy = _lora_policy(model_dir)
    shard_model(policy, mesh)
    half = len(IDS) // world
    out = _train(policy, IDS[rank * half : (rank + 1) * half])
    out["sharded"] = all(type(p).__name__ == "DTensor" for p in policy.parameters())
    # Collectives: every rank gathers every weight.
    out["weights"] = {name: full_tensor(p.detach()) for name, p in policy.named_parameters()}
    out["merged"] = dict(iter_full_weights(policy))
    out["adapter"] = dict(adapter_weights(policy))  # what rollout.lora_sync=adapter ships
    # The KL reference of a LoRA policy is the sharded module itself with its adapters off.
    with ReferencePolicy.of(policy, None).scoring() as reference, torch.no_grad():
        out["reference_logits"] = reference(input_ids=IDS[rank * half : (rank + 1) * half]).logits
    out["training_after_reference"] = policy.training
    with torch.no_grad():
        out["policy_logits"] = policy(input_ids=IDS[rank * half : (rank + 1) * half]).logits
    # Ranks sample different prompts: the engine's synced generation keeps the sharded forwards in lockstep.
    out["samples"] = _sample(policy, model_dir, IDS[rank, :6].tolist())
    return out


def _response_logprobs(model: torch.nn.Module, prompt: list[int], response: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1]
    return torch.log_softmax(logits / TEMPERATURE, -1).gather(-1, torch.tensor(response)[:, None]).squeeze(-1)


def _base_name(peft_name: str) -> str:
    return peft_name.removeprefix(PEFT_PREFIX).replace(".base_layer.", ".")


def test_two_ranks_train_a_sharded_lora_policy_as_one_process_does(tiny_dir, tmp_path):
    from stare_lightning.rollout.adapters import adapter_weights
    from stare_lightning.rollout.weights import iter_full_weights

    sharded = run_on_ranks(_sharded_worker, tmp_path, str(tiny_dir))
    reference = _lora_policy(str(tiny_dir))
    start = {name: p.detach().clone() for name, p in reference.named_parameters()}
    want = _train(reference, IDS)
    adapters = sorted(name for name, p in reference.named_parameters() if p.requires_grad)
    assert adapters and all(".lora_A." in name or ".lora_B." in name for name in adapters)

    for got in sharded.values():
        assert got["sharded"], "shard_model left parameters of the LoRA policy unsharded"
        assert got["losses"] == pytest.approx(want["losses"], rel=1e-5, abs=0)
        assert got["norms"] == pytest.approx(want["norms"], rel=1e-5, abs=0)
        # Only the adapters get gradients and optimizer state, on each rank as in one process.
        assert got["with_grad"] == got["with_state"] == want["with_grad"] == want["with_state"] == adapters

    got = sharded[0]
    base = load_file(Path(tiny_dir) / "model.safetensors")
    trained = dict(reference.named_parameters())
    for name, weight in got["weights"].items():
        if name in adapters:
            torch.testing.assert_close(weight, trained[name].detach(), atol=ATOL, rtol=0, msg=lambda m, n=name: n + m)
            assert (weight - start[name]).abs().max() > 50 * ATOL, f"{name} did not train"
        else:  # frozen: still the model directory's weight, bit for bit
            assert torch.equal(weight, base[_base_name(name)]), name

    # The weights a rollout engine receives: gathered from the shards, then merged, as from one process.
    merged = dict(iter_full_weights(reference))
    assert list(got["merged"]) == list(merged) and set(merged) == set(base)
    for name, weight in merged.items():
        torch.testing.assert_close(got["merged"][name], weight, atol=ATOL, rtol=0, msg=lambda m, n=name: n + m)

    # The adapters alone (adapter sync), gathered from the shards under the names of one process's adapters.
    want_adapter = dict(adapter_weights(reference))
    assert list(got["adapter"]) == list(want_adapter)
    for name, weight in want_adapter.items():
        torch.testing.assert_close(got["adapter"][name], weight, atol=ATOL, rtol=0, msg=lambda m, n=name: n + m)

    # The reference with the adapters off is the starting model, from each rank's shards; the adapters come back on.
    from transformers import AutoModelForCausalLM

    starting = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    half = len(IDS) // len(sharded)
    for rank, got_rank in sharded.items():
        with torch.no_grad():
            want_logits = starting(input_ids=IDS[rank * half : (rank + 1) * half]).logits
        torch.testing.assert_close(got_rank["reference_logits"], want_logits, atol=1e-5, rtol=0)
        assert got_rank["training_after_reference"], "scoring the reference left the policy in eval mode"
        assert (got_rank["policy_logits"] - want_logits).abs().max() > 1e-2, "the adapters stayed off"

    # Sampling from the sharded module: each rank's tokens carry the trained one-process policy's log-probs.
    reference.eval()
    for rank in sharded:
        for prompt, response, logprobs in sharded[rank]["samples"]:
            assert response
            want_lps = _response_logprobs(reference, prompt, response)
            torch.testing.assert_close(torch.tensor(logprobs), want_lps, atol=1e-4, rtol=0)


# ------------------------------------------------------------------------------------------- a real fit
# The random tiny model without its supervised warm-up (the slow part of a first fit) never earns a reward, so
# no advantage moves the adapters; an entropy bonus gives every step a gradient all the same. The KL term's
# reference is the sharded policy with its adapters off (no second model is loaded or sharded).
LORA_FSDP = [
    "debug=fast",
    "rollout=hf",
    "model.cold_start.steps=0",
    "algorithm=entropy_bonus",
    "algorithm.entropy_bonus.coef=0.1",
    "algorithm.kl.coef=0.05",
    "model.lora.rank=4",
    "optim.lr=1e-2",
    "validation.before_fit=false",
    "trainer.val_check_interval=100",
    "trainer=fsdp",
    "trainer.devices=2",
    "trainer.accelerator=cpu",
    "trainer.strategy.param_dtype=null",
    "data.prompts_per_step=4",
    "callbacks.model_checkpoint.every_n_train_steps=1",
    "trainer.max_steps=2",
]


def _full_checkpoint(checkpoint: Path, scratch: Path) -> tuple[dict, dict]:
    """(tensors, Lightning's meta) of a checkpoint; a distributed one read with torch's own converter."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    if checkpoint.is_file():  # trainer.strategy.save_distributed_checkpoint=false: one gathered file
        whole = torch.load(checkpoint, weights_only=False)
        return whole, whole
    dcp_to_torch_save(checkpoint, scratch)
    return torch.load(scratch, weights_only=False), torch.load(checkpoint / "meta.pt", weights_only=False)


# dcp_to_torch_save reads a distributed checkpoint in this one process, as intended, and warns that it does.
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("distributed", [True, False], ids=["distributed_checkpoint", "one_file"])
def test_sharded_lora_fit_resumes_and_exports_peft_merged_weights(tmp_path, model_cache, distributed):
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from stare_lightning.models.export import export_checkpoint

    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    overrides = [*LORA_FSDP, f"trainer.strategy.save_distributed_checkpoint={str(distributed).lower()}"]
    _fit([f"output_dir={straight}", *overrides], model_cache, tmp_path)
    kl = {step: row["train/kl"] for step, row in train_rows(read_metrics(straight)).items()}
    assert abs(kl[0]) < 1e-6 and kl[1] > 1e-6, f"the KL to the adapters-off reference should start at 0 and grow: {kl}"
    step1 = tmp_path / "step1.ckpt"  # a name without "=", which Hydra's override grammar would need quoted
    (shutil.copytree if distributed else shutil.copy)(straight / "checkpoints" / "epoch=0-step=1.ckpt", step1)
    _fit([f"output_dir={resumed}", *overrides, f"ckpt_path={step1}"], model_cache, tmp_path)
    # Resuming with fewer adapted modules would silently drop the checkpoint's other adapters: refused, named.
    narrowed = [f"output_dir={tmp_path / 'narrowed'}", *overrides, "model.lora.target_modules=[q_proj]"]
    proc = run_cli(["fit", *narrowed, f"ckpt_path={step1}"], model_cache, cwd=tmp_path)
    out, _ = proc.communicate(timeout=900)
    assert proc.returncode != 0 and "holds weights this run's model does not have" in out, out[-4000:]
    assert "mlp.down_proj.lora_A." in out, out[-4000:]  # the first of them, sorted

    last = resumed / "checkpoints" / "last.ckpt"
    assert last.is_dir() == distributed, "a distributed checkpoint is a directory, the gathered one a file"
    full, meta = _full_checkpoint(last, tmp_path / "resumed.pt")
    want, _ = _full_checkpoint(straight / "checkpoints" / "last.ckpt", tmp_path / "straight.pt")
    first, _ = _full_checkpoint(step1, tmp_path / "step1.pt")
    assert meta["global_step"] == 2
    policy = {k.removeprefix("policy."): v for k, v in full["state_dict"].items() if k.startswith("policy.")}
    straight_policy = {k.removeprefix("policy."): v for k, v in want["state_dict"].items() if k.startswith("policy.")}
    adapters = sorted(name for name in policy if ".lora_" in name)
    assert adapters and policy.keys() == straight_policy.keys()
    assert sorted(policy) == adapters, "the checkpoint should hold the adapters and no frozen base"
    assert not [k for k in full["state_dict"] if k.startswith("reference.")], "a second model was checkpointed"

    # The resumed step starts from the checkpoint's adapters and Adam moments: it ends where the straight run does.
    for name in adapters:
        torch.testing.assert_close(policy[name], straight_policy[name], atol=1e-6, rtol=0)
    moved = max(float((policy[n] - first["state_dict"][f"policy.{n}"]).abs().max()) for n in adapters)
    assert moved > 1e-4, "the resumed step left the adapters where the checkpoint had them"
    if distributed:
        state = full["optimizer_0"]["state"]
        assert sorted(k.removeprefix("policy.") for k in state) == adapters, "optimizer state beyond the adapters"
    else:  # Lightning keys a gathered file's optimizer state by parameter index
        state = full["optimizer_states"][0]["state"]
        assert len(state) == len(adapters), "optimizer state beyond the adapters"
    assert {float(s["step"]) for s in state.values()} == {2.0}, "Adam's step count did not survive the resume"

    model_dir = meta["hyper_parameters"]["model_dir"]
    base = load_file(Path(model_dir) / "model.safetensors")

    # The reference merge is peft's own: the checkpoint's tensors in a fresh peft model, merged and unloaded.
    lora = meta["hyper_parameters"]["model"]["lora"]
    alpha = lora["alpha"] if lora["alpha"] is not None else 2 * lora["rank"]  # model.lora.alpha's documented default
    wrapped = get_peft_model(
        AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
        PeftLoraConfig(r=lora["rank"], lora_alpha=alpha, target_modules=lora["target_modules"]),
    )
    missing, unexpected = wrapped.load_state_dict(policy, strict=False)  # the base is the model directory's
    assert not unexpected and missing and not [name for name in missing if ".lora_" in name]
    expected = wrapped.merge_and_unload().state_dict()

    exported = AutoModelForCausalLM.from_pretrained(export_checkpoint(last, tmp_path / "hf")).state_dict()
    assert exported.keys() == expected.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(exported[name], tensor, atol=1e-6, rtol=0, msg=lambda m, n=name: n + m)
    changed = [name for name in base if not torch.equal(exported[name], base[name])]
    assert changed and all(name.endswith("_proj.weight") for name in changed), changed
