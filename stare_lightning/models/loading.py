"""The trainable policy and the frozen reference model of a run, as ``ModelConfig`` describes them."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from stare_lightning.models.config import ModelConfig
from stare_lightning.models.lora import apply_lora


def load_policy(model_dir: str, cfg: ModelConfig) -> torch.nn.Module:
    """The policy in ``cfg.dtype``, with gradient checkpointing and LoRA adapters when asked for (then only the
    adapters train; the engine and exports get merged weights)."""
    policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, cfg.dtype))
    if cfg.gradient_checkpointing:
        policy.gradient_checkpointing_enable()
    if cfg.lora is not None:
        policy = apply_lora(policy, cfg.lora)
    return policy


def load_reference(model_dir: str, cfg: ModelConfig) -> torch.nn.Module:
    """The frozen starting policy a KL penalty measures against, in eval mode."""
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, cfg.dtype)).eval()
    return reference.requires_grad_(False)
