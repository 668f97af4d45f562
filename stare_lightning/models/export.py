"""Turn a ``fit`` checkpoint (one file, or a sharded distributed-checkpoint directory) into an HF directory."""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

POLICY_PREFIX = "policy."


def _load_checkpoint(path: Path) -> dict:
    if path.is_dir():  # a distributed checkpoint: tensors in *.distcp shards, the rest in meta.pt
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        with tempfile.TemporaryDirectory() as tmp:
            single = Path(tmp) / "checkpoint.pt"
            dcp_to_torch_save(str(path), str(single))
            checkpoint = torch.load(single, map_location="cpu", weights_only=False)
        meta = path / "meta.pt"
        if meta.is_file():
            checkpoint.update(torch.load(meta, map_location="cpu", weights_only=False))
        return checkpoint
    return torch.load(path, map_location="cpu", weights_only=False)


def export_checkpoint(ckpt_path: str | Path, export_dir: str | Path) -> Path:
    ckpt_path, export_dir = Path(ckpt_path), Path(export_dir)
    if not ckpt_path.exists():
        raise FileNotFoundError(f"ckpt_path={str(ckpt_path)!r} does not exist")
    checkpoint = _load_checkpoint(ckpt_path)
    model_dir = checkpoint.get("hyper_parameters", {}).get("model_dir")
    if model_dir is None or not Path(model_dir).is_dir():
        raise ValueError(
            f"{ckpt_path} does not name an existing base model directory (hyper_parameters.model_dir={model_dir!r})"
        )
    state = checkpoint.get("state_dict") or checkpoint.get("model") or {}
    weights = {k[len(POLICY_PREFIX) :]: v for k, v in state.items() if k.startswith(POLICY_PREFIX)}
    if not weights:
        raise ValueError(f"{ckpt_path} holds no policy weights (no state_dict keys start with {POLICY_PREFIX!r})")
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
