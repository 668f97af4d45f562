"""FSDP2 sharding with a bf16 MixedPrecisionPolicy on two gloo ranks, against an unsharded fp32 reference; the
CPU-offload policy's plumbing (strategy, sharding, refusals; no GPU here, so not its memory saving)."""

from __future__ import annotations

import pytest
import torch

from stare_lightning.models.tiny import build_tiny_model
from stare_lightning.trainer import FSDP2Strategy
from tests.distributed import run_on_ranks

IDS = torch.tensor([[5, 17, 3, 42, 8, 19, 23, 4, 11, 30], [7, 7, 2, 9, 41, 16, 5, 28, 3, 12]])


def _loss(model) -> tuple[torch.Tensor, torch.Tensor]:
    logits = model(IDS).logits
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].float().flatten(0, 1), IDS[:, 1:].flatten())
    return loss, logits


def _worker(rank: int, world: int, tiny_dir: str) -> dict | None:
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM

    from stare_lightning.models.sharding import shard_model

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("data_parallel",))
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    shard_model(model, mesh, mp_policy=FSDP2Strategy(param_dtype="bfloat16").mixed_precision_policy)
    loss, logits = _loss(model)  # the same batch on both ranks: the averaged gradient is that batch's
    loss.backward()
    out = {"logits_dtype": logits.dtype, "loss": float(loss), "grads": {}, "storage": set()}
    for name, param in model.named_parameters():
        out["storage"].add((param.to_local().dtype, param.grad.to_local().dtype))
        out["grads"][name] = param.grad.full_tensor()  # collective: every rank gathers
    return out if rank == 0 else None


@pytest.mark.slow
def test_bf16_policy_computes_in_bf16_and_keeps_fp32_master_weights(tmp_path):
    from transformers import AutoModelForCausalLM

    tiny_dir = build_tiny_model(tmp_path / "tiny", seed=0)
    results = run_on_ranks(_worker, tmp_path, str(tiny_dir))[0]
    assert results["logits_dtype"] == torch.bfloat16, "forward should run in the policy's param_dtype"
    assert results["storage"] == {(torch.float32, torch.float32)}, "sharded weights and gradients stay fp32"
    reference = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    loss, _ = _loss(reference)
    loss.backward()
    assert results["loss"] == pytest.approx(float(loss), rel=2e-2)
    worst = 0.0
    for name, param in reference.named_parameters():
        got, want = results["grads"][name], param.grad
        worst = max(worst, float((got - want).abs().max()))
        # bf16 keeps ~3 significant digits: close in norm, but not fp32-exact.
        assert float((got - want).norm() / want.norm().clamp_min(1e-12)) < 5e-2, name
    assert worst > 1e-6, "gradients equal to the fp32 ones: the bf16 policy was not applied"


def test_strategy_policy_and_bad_dtype():
    policy = FSDP2Strategy(param_dtype="bfloat16").mixed_precision_policy
    assert policy.param_dtype == torch.bfloat16 and policy.reduce_dtype == torch.float32
    assert FSDP2Strategy().mixed_precision_policy is None
    with pytest.raises(ValueError, match=r"trainer\.strategy\.param_dtype='fp8' is not allowed"):
        FSDP2Strategy(param_dtype="fp8")


def _offload_worker(rank: int, world: int, tiny_dir: str) -> dict | None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule
    from transformers import AutoModelForCausalLM

    from stare_lightning.models.sharding import shard_model

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("data_parallel",))
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    # pin_memory needs an accelerator; unpinned, FSDP2 accepts the policy on a CPU-only machine.
    shard_model(model, mesh, offload_policy=CPUOffloadPolicy(pin_memory=False))
    groups = [m._get_fsdp_state()._fsdp_param_group for m in model.modules() if isinstance(m, FSDPModule)]
    loss, _ = _loss(model)
    loss.backward()
    out = {
        "policies": [type(g.offload_policy).__name__ for g in groups if g is not None],
        "devices": {p.to_local().device.type for p in model.parameters()},
        "loss": float(loss),
    }
    return out if rank == 0 else None


@pytest.mark.slow
def test_shard_model_hands_the_offload_policy_to_every_fsdp2_group(tmp_path):
    """The plumbing only: on this CPU-only machine offload has nowhere to move the shards from, so no GPU
    memory is saved here; what is checked is that every decoder layer and the root shard with the policy."""
    from transformers import AutoModelForCausalLM

    tiny_dir = build_tiny_model(tmp_path / "tiny", seed=0)
    result = run_on_ranks(_offload_worker, tmp_path, str(tiny_dir))[0]
    layers = AutoModelForCausalLM.from_pretrained(tiny_dir).config.num_hidden_layers
    assert result["policies"] == ["CPUOffloadPolicy"] * (layers + 1) and result["devices"] == {"cpu"}
    assert result["loss"] == pytest.approx(float(_loss(AutoModelForCausalLM.from_pretrained(tiny_dir))[0]), rel=1e-5)


def test_cpu_offload_builds_fsdp2s_policy_and_a_host_backend():
    from torch.distributed.fsdp import CPUOffloadPolicy

    from stare_lightning.models.sharding import sharding_policies

    strategy = FSDP2Strategy(param_dtype="bfloat16", cpu_offload=True)
    policies = sharding_policies(strategy)
    assert isinstance(policies["offload_policy"], CPUOffloadPolicy) and policies["offload_policy"].pin_memory
    assert policies["mp_policy"].param_dtype == torch.bfloat16
    # Gradient clipping reduces the offloaded gradients' norms on the host: gloo beside NCCL.
    assert strategy.process_group_backend == "cuda:nccl,cpu:gloo"
    assert FSDP2Strategy(cpu_offload=True, process_group_backend="nccl").process_group_backend == "nccl"
    plain = FSDP2Strategy()
    assert plain.offload_policy is None and plain.process_group_backend is None
    assert sharding_policies(plain) == {"mp_policy": None, "offload_policy": None}
    with pytest.raises(ValueError, match=r"trainer\.strategy\.cpu_offload='yes' is not allowed"):
        FSDP2Strategy(cpu_offload="yes")


def test_cpu_offload_on_a_cpu_device_is_refused_before_any_process_group():
    strategy = FSDP2Strategy(cpu_offload=True)
    strategy.parallel_devices = [torch.device("cpu")]  # what trainer.accelerator=auto resolves to without a GPU
    with pytest.raises(ValueError, match="trainer.strategy.cpu_offload=true needs CUDA devices"):
        strategy.setup_environment()


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["trainer.accelerator=cpu"], "trainer.strategy.cpu_offload=true does nothing here"),
        (["rollout=hf"], "trainer.strategy.cpu_offload=true needs rollout.backend=vllm"),
    ],
)
def test_cpu_offload_config_refusals(tmp_path, overrides, message):
    from tests.test_config import compose_run

    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        compose_run(tmp_path, ["trainer=fsdp", "trainer.strategy.cpu_offload=true", *overrides])
    _, run = compose_run(tmp_path, ["trainer=fsdp", "trainer.strategy.cpu_offload=true", "rollout=vllm"])
    assert run.trainer["strategy"]["cpu_offload"] is True  # GPUs decide at setup (accelerator auto)
