"""Turn a ``fit`` checkpoint (one file, or a sharded distributed-checkpoint directory) into an HF directory.

A LoRA run's checkpoint holds the adapters under peft's names, and either the frozen base beside them or (since
checkpoints leave it out: ``trainer/frozen_base.py``) a record of the model directory it is, whose weights are
read again after checking the record's fingerprint. The export writes the base model's layout with every adapter
merged (``models/lora.py``), loadable without peft.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from stare_lightning.config.checks import choice
from stare_lightning.models.config import DTYPES, LoraConfig
from stare_lightning.models.lora import as_wrapped, merge_adapters
from stare_lightning.trainer.checkpoint_trust import (
    LIGHTNING_META_FILE,
    load_distributed_tensors,
    load_file,
    read_metadata,
    vet_checkpoint,
)
from stare_lightning.trainer.frozen_base import POLICY_PREFIX, check_same_base, recorded_base

# Where a distributed checkpoint keeps the module's weights: Lightning's Trainer saves them under "state_dict",
# Fabric under "model".
DISTRIBUTED_MODULE_KEYS = ("state_dict.", "model.")


def _load_checkpoint(path: Path) -> dict:
    """The checkpoint's policy weights and hyper-parameters, read as data only (``trainer/checkpoint_trust.py``)."""
    vet_checkpoint(path)
    if path.is_dir():  # a distributed checkpoint: tensors in *.distcp shards, the rest in Lightning's meta.pt
        meta = path / LIGHTNING_META_FILE
        checkpoint = load_file(meta) if meta.is_file() else {}
        names = read_metadata(path).state_dict_metadata
        prefix = next((p for p in DISTRIBUTED_MODULE_KEYS if any(n.startswith(p) for n in names)), "state_dict.")
        checkpoint["state_dict"] = load_distributed_tensors(path, prefix=prefix)
        return checkpoint
    return load_file(path)


def _with_frozen_base(weights: dict, checkpoint: dict, ckpt_path: Path, model_dir: str) -> dict:
    """The policy's weights with the frozen base an adapter-only checkpoint left out, read from ``model_dir``
    in the run's dtype and named as the peft-wrapped policy names them; a checkpoint holding its base as it is."""
    record = recorded_base(checkpoint)
    if record is None:
        return weights
    check_same_base(record, model_dir, ckpt_path)
    dtype = (checkpoint.get("hyper_parameters", {}).get("model") or {}).get("dtype", "float32")
    choice(f"{ckpt_path}: hyper_parameters.model.dtype", dtype, DTYPES)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).state_dict()
    adapted = {name.split(".lora_A.")[0] for name in weights if ".lora_A." in name}
    return {**dict(as_wrapped(base.items(), adapted)), **weights}


def _merged_lora(weights: dict, checkpoint: dict, ckpt_path: Path) -> dict:
    """The policy's weights with LoRA adapters merged, when the run trained adapters; else as they are."""
    if not any(".lora_A." in name for name in weights):
        return weights
    lora = (checkpoint.get("hyper_parameters", {}).get("model") or {}).get("lora")
    if lora is None:
        raise ValueError(f"{ckpt_path} holds LoRA adapters but no model.lora settings to merge them with")
    return dict(merge_adapters(weights.items(), LoraConfig(**lora).scaling))


def export_checkpoint(ckpt_path: str | Path, export_dir: str | Path) -> Path:
    ckpt_path, export_dir = Path(ckpt_path), Path(export_dir)
    checkpoint = _load_checkpoint(ckpt_path)
    model_dir = checkpoint.get("hyper_parameters", {}).get("model_dir")
    if model_dir is None or not Path(model_dir).is_dir():
        raise ValueError(
            f"{ckpt_path} does not name an existing base model directory (hyper_parameters.model_dir={model_dir!r})"
        )
    state = checkpoint.get("state_dict") or {}
    weights = {k[len(POLICY_PREFIX) :]: v for k, v in state.items() if k.startswith(POLICY_PREFIX)}
    if not weights:
        raise ValueError(f"{ckpt_path} holds no policy weights (no state_dict keys start with {POLICY_PREFIX!r})")
    weights = _merged_lora(_with_frozen_base(weights, checkpoint, ckpt_path, model_dir), checkpoint, ckpt_path)
    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(weights, strict=False, assign=True)
    missing = [name for name, p in model.named_parameters() if p.is_meta]
    if missing:
        raise ValueError(f"{ckpt_path} lacks weights for {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    export_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(export_dir)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(export_dir)
    return export_dir
