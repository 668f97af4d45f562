"""The correctness step of scripts/gpu_check.py: the project's tensor functions on the device vs float64 on the CPU.

Each comparison feeds both sides the same inputs, rounded to the device's dtype first, so a difference comes from
how the device computes, not from the rounding of the inputs:
- STARE-C2 token weights (top 10% by surprisal per advantage sign, W = 1.1, M = 0.9): entries that differ;
- the policy loss (clip 0.2 / 0.28, dual clip 10, token mean, with those weights) and its gradient: relative error;
- the fused LM head (log-probs and entropy from the hidden states a chunk at a time) against the plain head (the
  logits formed, then the same statistics) and both against float64 log-softmax; gradients of hidden and head;
- the telemetry metrics (token entropy, quadrant mass) updated with device tensors against CPU tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from stare_lightning.algorithms import (
    AlgorithmConfig,
    LossNormalizer,
    LossSpec,
    STARERule,
    policy_loss,
    stare_weights_for_scope,
)
from stare_lightning.algorithms.token_stats import token_stats_from_hidden, token_stats_from_logits
from stare_lightning.metrics.entropy import QuadrantMass, TokenEntropy

STARE_RULE = {"variant": "C2", "top_ratio": 0.1, "w": 1.1, "m": 0.9}
# Largest relative error accepted per compute dtype (the float64 result as the truth). bf16 keeps 8 bits of
# mantissa: its sums and products are good to a few parts in a thousand.
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2}


@dataclass(frozen=True)
class TensorSizes:
    rows: int  # sequences in the loss batch
    length: int  # tokens per sequence
    hidden_rows: int  # sequences through the LM head
    hidden_length: int
    model_width: int
    vocab: int


GPU_SIZES = TensorSizes(rows=64, length=1024, hidden_rows=4, hidden_length=512, model_width=1536, vocab=151936)
DRY_RUN_SIZES = TensorSizes(rows=8, length=24, hidden_rows=2, hidden_length=12, model_width=32, vocab=300)


def _relative_error(got: Tensor, want: Tensor) -> float:
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))


def _loss_batch(sizes: TensorSizes, generator: torch.Generator) -> dict[str, Tensor]:
    rows, length = sizes.rows, sizes.length
    lengths = torch.randint(1, length + 1, (rows,), generator=generator)
    lengths[0] = length
    logprobs = -torch.rand(rows, length, generator=generator, dtype=torch.float64) * 4
    return {
        "logprobs": logprobs,
        "old": logprobs + 0.2 * torch.randn(rows, length, generator=generator, dtype=torch.float64),
        "advantages": torch.randn(rows, generator=generator, dtype=torch.float64).masked_fill(
            torch.arange(rows) % 5 == 0, 0.0
        ),
        "mask": torch.arange(length).unsqueeze(0) < lengths.unsqueeze(1),
    }


def _stare_and_loss(batch: dict[str, Tensor], dtype: torch.dtype, device: torch.device) -> dict:
    """STARE weights, loss and gradient in ``dtype`` on ``device``, against float64 on the CPU from the same inputs."""
    spec = LossSpec.of(AlgorithmConfig(policy_loss={"clip_eps_high": 0.28, "dual_clip_c": 10.0}))
    rounded = {k: v.to(dtype) if v.is_floating_point() else v for k, v in batch.items()}
    results = {}
    for side, (side_dtype, side_device) in {"device": (dtype, device), "reference": (torch.float64, "cpu")}.items():
        inputs = {k: v.to(device=side_device, dtype=side_dtype if v.is_floating_point() else None) for k, v in
                  rounded.items()}  # fmt: skip
        logprobs = inputs["logprobs"].clone().requires_grad_()
        (weights,), (stats,) = stare_weights_for_scope(
            [inputs["logprobs"]],
            [inputs["advantages"]],
            [inputs["mask"]],
            scope="step",
            rule=STARERule.of(**STARE_RULE),
        )
        loss, _ = policy_loss(
            logprobs, inputs["old"], inputs["advantages"], inputs["mask"], spec,
            LossNormalizer.from_mask(inputs["mask"]), token_weights=weights.to(side_dtype),
        )  # fmt: skip
        loss.backward()
        results[side] = (weights.cpu(), stats, loss, logprobs.grad)
    (w_dev, s_dev, loss_dev, grad_dev), (w_ref, s_ref, loss_ref, grad_ref) = results["device"], results["reference"]
    return {
        "stare_weights_differing": int((w_dev.double() != w_ref.double()).sum()),
        "stare_selected": [int(s_dev.selected_pos), int(s_dev.selected_neg)],
        "stare_selected_reference": [int(s_ref.selected_pos), int(s_ref.selected_neg)],
        "loss": float(loss_dev),
        "loss_relative_error": _relative_error(loss_dev, loss_ref),
        "grad_relative_error": _relative_error(grad_dev, grad_ref),
    }


def _head_statistics(hidden: Tensor, weight: Tensor, targets: Tensor, fused: bool) -> tuple[Tensor, ...]:
    hidden, weight = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    if fused:
        stats = token_stats_from_hidden(hidden, weight, targets, chunk_size=256)
    else:
        stats = token_stats_from_logits(hidden @ weight.T, targets, chunk_size=256)
    (stats.logprobs.sum() + 0.01 * stats.entropy.sum()).backward()
    return stats.logprobs, stats.entropy, hidden.grad, weight.grad


def _float64_head(hidden: Tensor, weight: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
    """Log-probs and entropy from a float64 log-softmax: a reference that shares no code with the chunked pass."""
    logp = F.log_softmax(hidden.double().cpu() @ weight.double().cpu().T, dim=-1)
    return logp.gather(-1, targets.cpu().unsqueeze(-1)).squeeze(-1), -(logp.exp() * logp).sum(-1)


def _lm_head(sizes: TensorSizes, dtype: torch.dtype, device: torch.device, generator: torch.Generator) -> dict:
    shape = (sizes.hidden_rows, sizes.hidden_length, sizes.model_width)
    hidden = torch.randn(*shape, generator=generator).to(device=device, dtype=dtype)
    weight = (torch.randn(sizes.vocab, sizes.model_width, generator=generator) / sizes.model_width**0.5).to(
        device=device, dtype=dtype
    )
    targets = torch.randint(0, sizes.vocab, shape[:2], generator=generator).to(device)
    fused = _head_statistics(hidden, weight, targets, fused=True)
    plain = _head_statistics(hidden, weight, targets, fused=False)
    ref_logprobs, ref_entropy = _float64_head(hidden, weight, targets)
    names = ("logprobs", "entropy", "grad_hidden", "grad_head")
    result = {f"fused_vs_plain_{n}": _relative_error(f, p) for n, f, p in zip(names, fused, plain)}
    for head, stats in {"fused": fused, "plain": plain}.items():
        result[f"{head}_vs_float64_logprobs"] = _relative_error(stats[0], ref_logprobs)
        result[f"{head}_vs_float64_entropy"] = _relative_error(stats[1], ref_entropy)
    return result


def _telemetry(batch: dict[str, Tensor], device: torch.device, generator: torch.Generator) -> dict:
    """The largest difference between a metric fed device tensors and the same metric fed CPU tensors."""
    rows, length = batch["mask"].shape
    entropy = torch.rand(rows, length, generator=generator) * 3
    phi = torch.randn(rows, length, generator=generator)
    omega = 1 + (torch.rand(rows, length, generator=generator) < 0.1).float() * 0.1
    selected = omega > 1
    inputs = (batch["advantages"].float(), batch["mask"])
    values = {}
    for where in ("cpu", device):
        entropy_metric, quadrants = TokenEntropy().to(where), QuadrantMass().to(where)
        entropy_metric.update(entropy.to(where), batch["mask"].to(where))
        quadrants.update(*(x.to(where) for x in (*inputs, phi, omega, selected)))
        values[str(where)] = {**entropy_metric.compute(), **quadrants.compute()}
    cpu, dev = values["cpu"], values[str(device)]
    worst = 0.0
    for key, want in cpu.items():
        got = dev[key].cpu()
        both_nan = torch.isnan(got) & torch.isnan(want)
        worst = max(worst, float(torch.where(both_nan, 0.0, (got - want).abs()).max()))
    return {"metrics_compared": len(cpu), "max_abs_difference": worst}


def run(device: torch.device, sizes: TensorSizes) -> dict:
    """Every comparison, per dtype; ``passed`` says whether each stayed within TOLERANCE."""
    generator = torch.Generator().manual_seed(0)
    batch = _loss_batch(sizes, generator)
    report: dict = {"device": str(device), "sizes": sizes.__dict__, "tolerance": {str(k): v for k, v in
                                                                                  TOLERANCE.items()}}  # fmt: skip
    passed = True
    for dtype, tolerance in TOLERANCE.items():
        name = str(dtype).removeprefix("torch.")
        loss = _stare_and_loss(batch, dtype, device)
        head = _lm_head(sizes, dtype, device, generator)
        errors = [loss["loss_relative_error"], loss["grad_relative_error"], *head.values()]
        # Selection is exact on either side only where no two surprisals tie; bf16 inputs tie often, and a tie
        # may be broken differently on a device, so weights are held to exact equality in float32 only.
        ok = max(errors) <= tolerance and (dtype != torch.float32 or loss["stare_weights_differing"] == 0)
        report[name] = {"stare_and_loss": loss, "lm_head": head, "passed": ok}
        passed &= ok
    report["telemetry"] = _telemetry(batch, device, generator)
    report["telemetry"]["passed"] = report["telemetry"]["max_abs_difference"] <= 1e-5
    report["passed"] = passed and report["telemetry"]["passed"]
    return report
