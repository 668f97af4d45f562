"""LoRA through peft: wrap the policy so only low-rank adapters train, and fold the adapters back into full
weights under the base model's checkpoint names (for the rollout engine's weight sync and the HF export).

peft names a wrapped parameter ``base_model.model.<name>``; each targeted Linear becomes ``<layer>.base_layer``
plus ``<layer>.lora_A.default`` and ``<layer>.lora_B.default``. ``merge_adapters`` turns such a stream of
tensors into the base model's own: ``<layer>.weight = W + scaling * B @ A``, every other tensor unchanged. It
reads tensors and never writes them, so the trainer's module keeps its frozen base and its adapters (peft's
``merge_and_unload`` would fold them in place).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator

import torch

from stare_lightning.models.config import LoraConfig

ADAPTER = "default"  # peft's name for the one adapter get_peft_model adds
PEFT_PREFIX = "base_model.model."
# The suffix of each piece of a wrapped Linear -> its role in the merge.
_PIECES = {
    ".base_layer.weight": "weight",
    f".lora_A.{ADAPTER}.weight": "A",
    f".lora_B.{ADAPTER}.weight": "B",
}


def apply_lora(model: torch.nn.Module, cfg: LoraConfig) -> torch.nn.Module:
    """``model`` wrapped by peft with adapters on ``cfg.target_modules``; its own weights frozen."""
    try:
        from peft import LoraConfig as PeftLoraConfig
        from peft import get_peft_model
    except ImportError as error:
        raise ImportError("model.lora needs peft: pip install 'stare_lightning[lora]' (peft>=0.17)") from error
    peft_cfg = PeftLoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.scaling * cfg.rank,  # peft scales B @ A by lora_alpha / r
        lora_dropout=cfg.dropout,
        target_modules=list(cfg.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
    )
    try:
        wrapped = get_peft_model(model, peft_cfg)
    except ValueError as error:  # no module matches a target
        raise ValueError(f"model.lora.target_modules={list(cfg.target_modules)}: {error}") from error
    if getattr(model, "is_gradient_checkpointing", False):
        # Reentrant checkpointing (transformers 4.x's default) back-propagates into a block only when its input
        # needs a gradient; with the embeddings frozen none would, and the adapters would get no gradient.
        # transformers 5 does this itself in gradient_checkpointing_enable, 4.x only for its own peft loading.
        wrapped.enable_input_require_grads()
    return wrapped


def is_lora(model: torch.nn.Module) -> bool:
    """Whether ``model`` is a peft model (peft is not imported for the question)."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)


def base_model(model: torch.nn.Module) -> torch.nn.Module:
    """The Hugging Face model inside a peft wrapper, or ``model``."""
    return model.get_base_model() if is_lora(model) else model


def adapter_scaling(model: torch.nn.Module) -> float:
    """The one ``alpha / rank`` of every LoRA layer of ``model`` (``apply_lora`` gives them all the same)."""
    from peft.tuners.lora import LoraLayer

    values = {float(m.scaling[ADAPTER]) for m in model.modules() if isinstance(m, LoraLayer)}
    if len(values) != 1:
        raise ValueError(f"expected one LoRA scaling for every layer, found {sorted(values)}")
    return values.pop()


def merge_adapters(named: Iterable[tuple[str, torch.Tensor]], scaling: float) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of a peft-wrapped model -> the base model's ``(checkpoint name, tensor)``.

    Tensors arrive in any order; a wrapped layer's merged weight is yielded once its base weight and both
    adapter matrices have been seen (in module order: right after its last piece), so at most a few
    tensors wait at a time.
    """
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in named:
        name = name.removeprefix(PEFT_PREFIX)
        layer, role = _piece(name)
        if role is None:
            yield name.replace(".base_layer.", "."), tensor  # a wrapped layer's bias, or an untouched parameter
            continue
        parts = pending.setdefault(layer, {})
        parts[role] = tensor
        if len(parts) == len(_PIECES):
            del pending[layer]
            yield f"{layer}.weight", merged_weight(parts["weight"], parts["A"], parts["B"], scaling)
    if pending:
        incomplete = {layer: sorted(parts) for layer, parts in list(pending.items())[:3]}
        raise ValueError(f"LoRA layers without all of base weight, A and B: {incomplete}")


def as_wrapped(named: Iterable[tuple[str, torch.Tensor]], adapted: set[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """The base model's ``(name, tensor)`` under the names its peft wrapper gives them: ``adapted`` names the
    wrapped layers (as the adapters' names spell them, with peft's prefix), whose tensors move to ``base_layer``."""
    for name, tensor in named:
        layer, _, leaf = f"{PEFT_PREFIX}{name}".rpartition(".")
        yield (f"{layer}.base_layer.{leaf}" if layer in adapted else f"{layer}.{leaf}"), tensor


def merged_weight(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    """``W + scaling * B @ A`` in ``W``'s dtype (computed in fp32 when ``W`` is narrower)."""
    with torch.no_grad():
        if weight.dtype == torch.float32:
            return weight + scaling * (b.float() @ a.float())
        return (weight.float() + scaling * (b.float() @ a.float())).to(weight.dtype)


def _piece(name: str) -> tuple[str, str | None]:
    """(the wrapped layer's name, "weight" / "A" / "B"), or (name, None) for a tensor the merge passes on."""
    for suffix, role in _PIECES.items():
        if name.endswith(suffix):
            return name[: -len(suffix)], role
    if ".lora_" in name:  # another adapter, DoRA magnitudes, embedding adapters: nothing apply_lora makes
        raise ValueError(f"cannot merge {name!r}: only adapter {ADAPTER!r} on Linear layers is supported")
    return name, None
