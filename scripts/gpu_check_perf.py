"""The performance step of scripts/gpu_check.py: the training update on a real architecture, randomly initialised.

The model is built from Qwen2.5-1.5B's published shape (no download; random weights are fine for speed and memory).
One update is what the trainer does for one step's rows: the rows are packed into micro-batches of at most
``micro_batch_tokens``, each goes through the project's forward (``response_token_stats``: log-probs and entropy)
and the STARE policy loss, backward, then one AdamW step; fp32 master weights under bf16 autocast, as
``trainer=gpu`` trains. Each (response length, LM head, gradient checkpointing) setting runs one warm-up update and
then ``timed_updates`` timed ones.

- tokens/s: prompt and response tokens of the step's rows over the update's wall time.
- MFU: model FLOPs over the chip's dense bf16 peak (989 TFLOP/s for H100 SXM and H200, 756 for H100 PCIe; none
  named for another device, so no MFU). Model FLOPs of an update = 6 * N * tokens + 6 * layers * width * sum over
  rows of length^2, with N the parameters that multiply every token (all but the input embedding, whose lookup
  costs nothing; a tied embedding counts once, as the LM head) and the second term the causal attention's two
  matmuls, forward and backward (a row attends to itself only: rows are packed). Recomputation under gradient
  checkpointing is not counted (MFU, not hardware FLOPs utilisation).
- peak memory: ``torch.cuda.max_memory_allocated`` during the timed updates, and its growth over what was allocated
  before them (weights, gradients and optimizer state exist by then).
- HF generation tokens/s: ``model.generate`` in bf16, sampling, every row forced to its full length. This is
  Hugging Face's generation loop, not vLLM, which cannot travel to an offline machine.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from stare_lightning.algorithms import AlgorithmConfig, LossNormalizer, LossSpec, policy_loss
from stare_lightning.rollout.base import Rollouts
from stare_lightning.step import micro_batches
from stare_lightning.step.batch import build_rollout_batch
from stare_lightning.step.forward import ForwardLayout, response_token_stats

# Qwen2.5-1.5B's configuration numbers.
QWEN2_5_1_5B = {
    "hidden_size": 1536,
    "intermediate_size": 8960,
    "num_hidden_layers": 28,
    "num_attention_heads": 12,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
    "max_position_embeddings": 32768,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
}
DRY_RUN_MODEL = {**QWEN2_5_1_5B, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                 "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512}  # fmt: skip
PEAK_BF16_TFLOPS = (("H100 PCIe", 756.0), ("H100", 989.0), ("H200", 989.0))


@dataclass(frozen=True)
class PerfSizes:
    model: dict
    response_lengths: tuple[int, ...]
    prompt_length: int
    step_tokens: int  # rows per update = step_tokens // (prompt + response)
    micro_batch_tokens: int
    timed_updates: int
    generate_rows: int
    generate_tokens: int


GPU_SIZES = PerfSizes(QWEN2_5_1_5B, (1024, 4096), 128, 16384, 8192, 2, 32, 256)
DRY_RUN_SIZES = PerfSizes(DRY_RUN_MODEL, (16, 32), 8, 160, 96, 1, 2, 4)


def peak_tflops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for marker, peak in PEAK_BF16_TFLOPS if marker in name), None)


def build_model(sizes: PerfSizes, device: torch.device) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(0)
    with device:  # initialised where it runs: a 1.5B model's init on the host would take minutes
        return AutoModelForCausalLM.from_config(Qwen2Config(**sizes.model), dtype=torch.float32)


def multiplying_parameters(model: torch.nn.Module) -> int:
    embedding = model.get_input_embeddings().weight
    tied = model.get_output_embeddings().weight is embedding
    return sum(p.numel() for p in model.parameters()) - (0 if tied else embedding.numel())


def _step_batch(sizes: PerfSizes, response: int, vocab: int):
    generator = torch.Generator().manual_seed(response)
    rows = max(1, sizes.step_tokens // (sizes.prompt_length + response))
    rollouts = Rollouts(
        prompt_ids=[torch.randint(3, vocab, (sizes.prompt_length,), generator=generator).tolist() for _ in range(rows)],
        response_ids=[torch.randint(3, vocab, (response,), generator=generator).tolist() for _ in range(rows)],
        response_logprobs=[[-1.0] * response for _ in range(rows)],
        texts=[""] * rows,
        finish_reasons=["length"] * rows,
        n=rows,
    )
    advantages = torch.randn(rows, generator=generator)
    return build_rollout_batch(rollouts, advantages, advantages, pad_token_id=0)


def _update(model, optimizer, batch, sizes: PerfSizes, layout: ForwardLayout, spec: LossSpec) -> None:
    device = next(model.parameters()).device
    normalizer = LossNormalizer.from_mask(batch.response_mask)
    for part in micro_batches(batch, sizes.micro_batch_tokens, packed=True):
        with torch.autocast(device.type, dtype=torch.bfloat16):
            stats = response_token_stats(model, part, layout, temperature=1.0, chunk_size=4096)
        old = stats.logprobs.detach()
        loss, _ = policy_loss(stats.logprobs, old, part.advantages, part.response_mask, spec, normalizer)
        loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=False)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_update(model, optimizer, sizes: PerfSizes, response: int, fused: bool, checkpointing: bool) -> dict:
    device = next(model.parameters()).device
    if checkpointing:
        model.gradient_checkpointing_enable()
    else:
        model.gradient_checkpointing_disable()
    layout = ForwardLayout(packed=True, fused_head=fused, share_prompts=False)
    spec = LossSpec.of(AlgorithmConfig(policy_loss={"clip_eps_high": 0.28}))
    batch = _step_batch(sizes, response, model.config.vocab_size).to(device)
    _update(model, optimizer, batch, sizes, layout, spec)  # warm-up: kernels chosen, optimizer state allocated
    _synchronize(device)
    before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    started = time.perf_counter()
    for _ in range(sizes.timed_updates):
        _update(model, optimizer, batch, sizes, layout, spec)
    _synchronize(device)
    seconds = (time.perf_counter() - started) / sizes.timed_updates
    lengths = batch.attention_mask.sum(-1).double()
    config = model.config
    flops = 6 * multiplying_parameters(model) * float(lengths.sum()) + 6 * config.num_hidden_layers * (
        config.num_attention_heads * (config.hidden_size // config.num_attention_heads)
    ) * float((lengths**2).sum())
    peak = peak_tflops(device)
    result = {
        "response_tokens": response,
        "rows": int(lengths.numel()),
        "tokens": int(lengths.sum()),
        "fused_lm_head": fused,
        "gradient_checkpointing": checkpointing,
        "update_s": seconds,
        "tokens_per_s": float(lengths.sum()) / seconds,
        "model_tflops_per_update": flops / 1e12,
        "mfu": None if peak is None else flops / seconds / (peak * 1e12),
    }
    if device.type == "cuda":
        result["peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        result["peak_growth_gib"] = (torch.cuda.max_memory_allocated(device) - before) / 2**30
    return result


def measure_generation(model, sizes: PerfSizes) -> dict:
    device = next(model.parameters()).device
    model.to(torch.bfloat16).eval()
    prompts = torch.randint(3, model.config.vocab_size, (sizes.generate_rows, sizes.prompt_length), device=device)
    settings = {"do_sample": True, "max_new_tokens": sizes.generate_tokens, "min_new_tokens": sizes.generate_tokens}
    with torch.no_grad():
        model.generate(prompts, max_new_tokens=2, min_new_tokens=2, do_sample=True)  # warm-up
        _synchronize(device)
        started = time.perf_counter()
        out = model.generate(prompts, **settings)
        _synchronize(device)
    seconds = time.perf_counter() - started
    generated = (out.shape[1] - sizes.prompt_length) * out.shape[0]
    return {
        "engine": "HF generate (not vLLM)",
        "rows": sizes.generate_rows,
        "new_tokens_per_row": sizes.generate_tokens,
        "seconds": seconds,
        "tokens_per_s": generated / seconds,
    }


def run(device: torch.device, sizes: PerfSizes) -> dict:
    """Every setting's update figures (an out-of-memory setting is recorded as such), then HF generation."""
    model = build_model(sizes, device)
    model.config.use_cache = False
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=device.type == "cuda")
    report: dict = {"model": "Qwen2.5-1.5B shape, random weights" if sizes.model is QWEN2_5_1_5B else "tiny Qwen2",
                    "parameters": sum(p.numel() for p in model.parameters()),
                    "multiplying_parameters": multiplying_parameters(model),
                    "peak_bf16_tflops": peak_tflops(device), "updates": []}  # fmt: skip
    for response in sizes.response_lengths:
        for fused in (False, True):
            for checkpointing in (False, True):
                setting = {"response_tokens": response, "fused_lm_head": fused, "gradient_checkpointing": checkpointing}
                try:
                    report["updates"].append(measure_update(model, optimizer, sizes, response, fused, checkpointing))
                except torch.OutOfMemoryError as error:
                    report["updates"].append({**setting, "error": f"out of memory: {str(error).splitlines()[0]}"})
                    optimizer.zero_grad(set_to_none=False)
                    torch.cuda.empty_cache()
    del optimizer
    model.gradient_checkpointing_disable()
    model.config.use_cache = True
    report["generation"] = measure_generation(model, sizes)
    return report
