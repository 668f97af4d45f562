"""Weight pushes through files, the file half of the ``stare_lightning`` weight-transfer backend's wire format.

The trainer packs its tensors into chunk files in a private directory it holds by descriptor (``write_chunks``,
``transfer_dir.py``) and posts each chunk's JSON description (an ``update_info``: file name, tensor names, dtype
names, shapes, byte sizes) to the server's ``/update_weights``. The server's side (``transfer_engine.py``, loaded
by vLLM through ``plugin.py``) checks every description here (``parse_chunk``) and against the served checkpoint
(``checkpoint_shapes``) before it reads a byte. Nothing is unpickled: descriptions are JSON, chunks are raw
little-endian tensor bytes.

This module does not import vLLM: the trainer uses it without.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from stare_lightning.rollout.transfer_dir import ChunkDirectory

__all__ = [
    "BACKEND",
    "DTYPES",
    "ChunkSpec",
    "TransferRefused",
    "check_wire_dtype",
    "checkpoint_shapes",
    "parse_chunk",
    "parse_tensor_lists",
    "refuse_non_finite",
    "write_chunks",
]

# The name the server's backend is registered under (``--weight-transfer-config '{"backend": BACKEND}'``).
BACKEND = "stare_lightning"
DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
TENSOR_LIST_KEYS = ("names", "dtype_names", "shapes", "tensor_sizes")
UPDATE_INFO_KEYS = ("file", *TENSOR_LIST_KEYS)

# A chunk file is a plain name inside the transfer directory: no separators, no leading dot ("." and ".." too).
_FILE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
# Checkpoint tensor names: dotted identifiers and indexes.
_TENSOR_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,511}")
_MAX_DIMS = 8
# A safetensors header is JSON of a few kB per hundred tensors; anything near this is not a checkpoint header.
_MAX_HEADER_BYTES = 100 << 20


class TransferRefused(ValueError):
    """A weight push the server's backend refuses; the model is left as it was."""


@dataclass(frozen=True)
class ChunkSpec:
    """One chunk's checked description: its tensors lie back to back in ``file``, in ``names`` order."""

    file: str
    names: tuple[str, ...]
    dtype_names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    sizes: tuple[int, ...]

    @property
    def total_bytes(self) -> int:
        return sum(self.sizes)


def write_chunks(
    weights: Iterable[tuple[str, torch.Tensor]], directory: ChunkDirectory | str | Path, chunk_bytes: int = 64 << 20
) -> Iterator[dict]:
    """Pack ``(name, tensor)`` pairs into new files ``chunk-<k>.bin`` of about ``chunk_bytes`` each in ``directory``
    and yield each chunk's ``update_info`` as soon as its file is written. A tensor larger than ``chunk_bytes`` gets
    a chunk of its own. Tensors go to the CPU, detached and contiguous; their dtype must be one of ``DTYPES``.
    Files are created relative to the directory's descriptor, never by path, and never over an existing name
    (``ChunkDirectory.create``); a path is opened as a ``ChunkDirectory`` for the duration."""
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    if not isinstance(directory, ChunkDirectory):
        with ChunkDirectory(directory) as opened:
            yield from write_chunks(weights, opened, chunk_bytes)
        return
    pending: list[tuple[str, torch.Tensor]] = []
    pending_bytes, index = 0, 0
    for name, tensor in weights:
        tensor = _wire_tensor(name, tensor)
        size = tensor.numel() * tensor.element_size()
        if pending and pending_bytes + size > chunk_bytes:
            yield _write_chunk(directory, index, pending)
            pending, pending_bytes, index = [], 0, index + 1
        pending.append((name, tensor))
        pending_bytes += size
        if pending_bytes >= chunk_bytes:
            yield _write_chunk(directory, index, pending)
            pending, pending_bytes, index = [], 0, index + 1
    if pending:
        yield _write_chunk(directory, index, pending)


def check_wire_dtype(name: str, tensor: torch.Tensor) -> None:
    dtype_name = str(tensor.dtype).removeprefix("torch.")
    if dtype_name not in DTYPES:
        raise ValueError(f"weight {name!r} has dtype {dtype_name}; a weight push carries only {sorted(DTYPES)}")


def _wire_tensor(name: str, tensor: torch.Tensor) -> torch.Tensor:
    check_wire_dtype(name, tensor)
    # A copy: the file is written through a numpy view, which marks the storage it views non-resizable, and an
    # FSDP2 parameter held unsharded (the root's, after its forward) must stay resizable for FSDP to free it.
    return tensor.detach().to("cpu", copy=True).contiguous()


def _write_chunk(directory: ChunkDirectory, index: int, tensors: list[tuple[str, torch.Tensor]]) -> dict:
    file = f"chunk-{index}.bin"
    with directory.create(file) as out:
        for _, tensor in tensors:
            out.write(tensor.reshape(-1).view(torch.uint8).numpy().data)
    return {
        "file": file,
        "names": [name for name, _ in tensors],
        "dtype_names": [str(tensor.dtype).removeprefix("torch.") for _, tensor in tensors],
        "shapes": [list(tensor.shape) for _, tensor in tensors],
        "tensor_sizes": [tensor.numel() * tensor.element_size() for _, tensor in tensors],
    }


def refuse_non_finite(tensor: torch.Tensor, name: str, where: str) -> None:
    """A tensor holding NaN or inf is refused before it is staged: served, it would sample garbage under the new
    version and leave non-finite values in reused KV-cache blocks."""
    finite = torch.isfinite(tensor)
    if not bool(finite.all()):
        raise TransferRefused(
            f"{where}: tensor {name!r} holds {int(finite.numel() - finite.sum())} non-finite values (NaN or inf); "
            "the model keeps its weights"
        )


def parse_chunk(update_info: object) -> ChunkSpec:
    """Check a chunk description on its own (types, names, dtypes, shapes against byte sizes); raise
    ``TransferRefused`` naming the first problem. The file and the model are checked by the caller."""
    if not isinstance(update_info, dict):
        raise TransferRefused(f"update_info must be a JSON object, got {type(update_info).__name__}")
    file = update_info.get("file")
    if not isinstance(file, str) or not _FILE_NAME.fullmatch(file):
        raise TransferRefused(
            f"update_info.file {file!r} is not a plain file name (letters, digits, '.', '_', '-'; no '/', no "
            "leading '.')"
        )
    return parse_tensor_lists(update_info, UPDATE_INFO_KEYS, file)


def parse_tensor_lists(update_info: dict, allowed_keys: tuple[str, ...], file: str) -> ChunkSpec:
    """The tensor lists of a chunk description whose keys must be exactly ``allowed_keys`` (the file backend's, or
    the network's in ``net_wire.py``)."""
    keys = set(update_info)
    if keys != set(allowed_keys):
        raise TransferRefused(
            f"update_info has keys {sorted(keys)}; expected exactly {list(allowed_keys)}"
            + (f" (unknown: {sorted(keys - set(allowed_keys))})" if keys - set(allowed_keys) else "")
        )
    lists = {key: update_info[key] for key in TENSOR_LIST_KEYS}
    for key, value in lists.items():
        if not isinstance(value, list):
            raise TransferRefused(f"update_info.{key} must be a list, got {type(value).__name__}")
    lengths = {key: len(value) for key, value in lists.items()}
    if len(set(lengths.values())) != 1:
        raise TransferRefused(f"update_info's lists differ in length: {lengths}")
    if lengths["names"] == 0:
        raise TransferRefused("update_info names no tensor: a chunk carries at least one")
    names = tuple(_check_name(name) for name in lists["names"])
    if len(set(names)) != len(names):
        raise TransferRefused(f"update_info names a tensor twice: {_duplicates(names)}")
    dtype_names = tuple(_check_dtype(name, dtype) for name, dtype in zip(names, lists["dtype_names"]))
    shapes = tuple(_check_shape(name, shape) for name, shape in zip(names, lists["shapes"]))
    sizes = []
    for name, dtype, shape, size in zip(names, dtype_names, shapes, lists["tensor_sizes"]):
        if not _is_int(size) or size < 0:
            raise TransferRefused(f"tensor {name!r}: tensor_sizes entry {size!r} is not a non-negative integer")
        expected = math.prod(shape) * DTYPES[dtype].itemsize
        if size != expected:
            raise TransferRefused(
                f"tensor {name!r}: {size} bytes do not match shape {list(shape)} of {dtype} ({expected} bytes)"
            )
        sizes.append(size)
    return ChunkSpec(file=file, names=names, dtype_names=dtype_names, shapes=shapes, sizes=tuple(sizes))


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_name(name: object) -> str:
    if not isinstance(name, str) or not _TENSOR_NAME.fullmatch(name):
        raise TransferRefused(f"tensor name {name!r} is not a checkpoint name (letters, digits, '_', '.', '-')")
    return name


def _check_dtype(name: str, dtype: object) -> str:
    if dtype not in DTYPES:
        raise TransferRefused(f"tensor {name!r}: dtype {dtype!r} is not one of {sorted(DTYPES)}")
    return dtype  # type: ignore[return-value]


def _check_shape(name: str, shape: object) -> tuple[int, ...]:
    if (
        not isinstance(shape, list)
        or len(shape) > _MAX_DIMS
        or not all(_is_int(dim) and 0 <= dim < 1 << 40 for dim in shape)
    ):
        raise TransferRefused(
            f"tensor {name!r}: shape {shape!r} is not a list of at most {_MAX_DIMS} non-negative integers"
        )
    return tuple(shape)


def _duplicates(names: Iterable[str]) -> list[str]:
    seen: set[str] = set()
    return sorted({name for name in names if name in seen or seen.add(name)})


def checkpoint_shapes(model_dir: str | Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape of every tensor in the ``*.safetensors`` files of a checkpoint directory, read from the
    files' JSON headers only (no tensor data is read)."""
    directory = Path(model_dir)
    files = sorted(directory.glob("*.safetensors")) if directory.is_dir() else []
    if not files:
        raise TransferRefused(
            f"the served model {str(model_dir)!r} is not a directory with *.safetensors files: weight pushes check "
            "each tensor's name and shape against the served checkpoint, so serve a local safetensors checkpoint"
        )
    shapes: dict[str, tuple[int, ...]] = {}
    for file in files:
        for name, shape in _safetensors_header(file).items():
            shapes[name] = shape
    return shapes


def _safetensors_header(file: Path) -> dict[str, tuple[int, ...]]:
    with open(file, "rb") as stream:
        length = int.from_bytes(stream.read(8), "little")
        if not 0 < length <= _MAX_HEADER_BYTES:
            raise TransferRefused(f"{file}: not a safetensors file (header length {length})")
        try:
            header = json.loads(stream.read(length))
        except ValueError as err:
            raise TransferRefused(f"{file}: unreadable safetensors header ({err})") from err
    if not isinstance(header, dict):
        raise TransferRefused(f"{file}: the safetensors header is not a JSON object")
    shapes = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        shape = entry.get("shape") if isinstance(entry, dict) else None
        if not isinstance(shape, list) or not all(_is_int(dim) and dim >= 0 for dim in shape):
            raise TransferRefused(f"{file}: tensor {name!r} has no valid shape in the header")
        shapes[name] = tuple(shape)
    return shapes
