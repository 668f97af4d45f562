"""Checkpoints without the frozen base: a LoRA run writes what it trains, not the model it started from.

A LoRA policy's base weights never change in training and are the model directory's own, so writing them
into every checkpoint stores the same bytes again and again (SmolLM2-135M with rank-16 adapters: 598 MB a
checkpoint, of which 59 MB are the adapters, their AdamW moments and the run's state; a 7B base is 15 GB in
bf16). A checkpoint of such a policy keeps its trainable parameters, the optimizer state (which covers the
adapters only) and everything else, and records which base it left out: the model directory and a fingerprint
of its files. Loading it (resume, ``validate``, ``export``) takes the frozen tensors from the loaded base again,
after checking the fingerprint: another model at the same path would silently change what the adapters apply
to. A checkpoint that holds its base loads as it always did.

The fingerprint reads each weight or config file's name, size and sixteen 64 KiB blocks spread over it, so it
costs the same for any model size. It tells another model from the one trained on (another fine-tune of the
same architecture differs in nearly every block); it does not detect an edit of a few bytes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from pathlib import Path

import torch

POLICY_PREFIX = "policy."  # the policy's weights in the module's state dict (the module's attribute)
RUN_STATE = "stare_lightning"  # the checkpoint's entry for the run's own state (run_state.py)
RECORD = "frozen_base"  # the base a checkpoint left out, under RUN_STATE
_FILES = ("*.safetensors", "pytorch_model*.bin", "config.json")
_BLOCK = 64 * 1024
_BLOCKS_PER_FILE = 16


def fingerprint(model_dir: str | Path) -> str:
    """A digest of the model directory's weight and config files (module docstring: what it can tell apart)."""
    files = sorted({path for pattern in _FILES for path in Path(model_dir).glob(pattern) if path.is_file()})
    if not files:
        raise FileNotFoundError(f"{model_dir} holds no model weights ({', '.join(_FILES)})")
    digest = hashlib.sha256()
    for path in files:
        size = path.stat().st_size
        digest.update(f"{path.name}\0{size}\0".encode())
        with path.open("rb") as handle:
            for offset in _block_offsets(size):
                handle.seek(offset)
                digest.update(handle.read(_BLOCK))
    return digest.hexdigest()


def _block_offsets(size: int) -> list[int]:
    """Where the sampled blocks start: the whole file when it is small, else evenly spread, first and last in."""
    if size <= _BLOCK * _BLOCKS_PER_FILE:
        return list(range(0, size, _BLOCK))
    stride = (size - _BLOCK) / (_BLOCKS_PER_FILE - 1)
    return [round(i * stride) for i in range(_BLOCKS_PER_FILE)]


def frozen_keys(module: torch.nn.Module) -> list[str]:
    """The state-dict keys of ``module`` that training does not change: frozen parameters and buffers."""
    trainable = {name for name, parameter in module.named_parameters() if parameter.requires_grad}
    return [key for key in module.state_dict(keep_vars=True) if key not in trainable]


def omit_frozen_base(checkpoint: dict, policy: torch.nn.Module, prefix: str, model_dir: str) -> None:
    """Drop the policy's frozen tensors (under ``prefix``) from ``checkpoint["state_dict"]`` and record the base,
    when some of its parameters are frozen (LoRA); a policy that trains every parameter is written whole.

    A full-state FSDP2 checkpoint has an empty state dict on ranks other than 0; that is fine: nothing to drop.
    """
    if all(parameter.requires_grad for parameter in policy.parameters()):
        return
    state = checkpoint.get("state_dict") or {}
    for key in frozen_keys(policy):
        state.pop(prefix + key, None)
    record = {"model_dir": str(model_dir), "fingerprint": fingerprint(model_dir)}
    checkpoint.setdefault(RUN_STATE, {})[RECORD] = record


def recorded_base(checkpoint: Mapping) -> Mapping | None:
    """The base an adapter-only checkpoint left out (``omit_frozen_base``'s record), or None for one that holds it."""
    return (checkpoint.get(RUN_STATE) or {}).get(RECORD)


def check_same_base(record: Mapping, model_dir: str | Path, checkpoint: str | Path | None) -> None:
    """Refuse a checkpoint whose left-out base is not the model at ``model_dir`` (the fingerprints differ)."""
    name = checkpoint or "the checkpoint"
    if not isinstance(record, Mapping) or not all(isinstance(record.get(k), str) for k in ("model_dir", "fingerprint")):
        raise ValueError(
            f"{name}: {RUN_STATE}.{RECORD} must map model_dir and fingerprint to strings, not {record!r:.200}"
        )
    if fingerprint(model_dir) == record["fingerprint"]:
        return
    raise ValueError(
        f"{name} holds LoRA adapters without their frozen base, which was the model at {record['model_dir']}; "
        f"the model at {model_dir} is not that model (its weight files' fingerprint differs). Put the original "
        "model back at that path, or point model.name_or_path at a copy of it"
    )


def restore_frozen_base(
    checkpoint: dict, policy: torch.nn.Module, prefix: str, model_dir: str, path: str | Path | None
) -> None:
    """Check an adapter-only checkpoint's base and put the loaded policy's frozen tensors back into its state
    dict, so that the strict load that follows gets every key. A checkpoint that holds its base is untouched.

    A sharded checkpoint arrives without ``state_dict``: ``FSDP2Strategy`` has loaded what it holds already.
    """
    record = recorded_base(checkpoint)
    if record is None:
        return
    check_same_base(record, model_dir, path)
    state = checkpoint.get("state_dict")
    if state is None:
        return
    own = policy.state_dict()
    for key in frozen_keys(policy):
        state.setdefault(prefix + key, own[key])
