"""Reading checkpoints that someone else wrote: every byte is data, nothing in them can run code.

The policy, for every path that reads a checkpoint (``fit``/``validate`` resume, ``export``, ``evaluate``, LoRA,
FSDP2): a checkpoint is untrusted input. Pickles inside it are read only with ``weights_only`` semantics, i.e.
tensors, containers and plain values; anything else is refused with an error naming the file, before a model is
built or a step taken.

A single-file checkpoint is one ``torch.load(weights_only=True)``. A distributed checkpoint (a directory written
by ``torch.distributed.checkpoint``, as FSDP2 runs save) holds three kinds of pickle, and torch reads two of them
permissively: the ``.metadata`` index (a plain ``pickle.load``), and every non-tensor entry of the state (optimizer
hyper-parameters, loop counters; ``torch.load(weights_only=False)`` in the default load planner). Here:

- ``.metadata`` goes through ``_MetadataUnpickler``, which knows only the classes torch's format writes (the
  dataclasses of ``torch.distributed.checkpoint.metadata``, ``torch.Size``, dtypes, a path);
- non-tensor entries are loaded with ``weights_only=True`` (``DataOnlyLoadPlanner``);
- every storage file the index names must be a plain file inside the checkpoint directory.

``vet_checkpoint`` reads all of that up front, so a hostile checkpoint fails before the run starts; Lightning then
loads the vetted directory itself with ``weights_only=True``. (A checkpoint rewritten between the check and the
load is outside this model: whoever can write the directory during a run already controls the run.)
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path, PurePosixPath
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, StorageMeta, TensorStorageMetadata

__all__ = [
    "DataOnlyLoadPlanner",
    "DataOnlyReader",
    "UntrustedCheckpointError",
    "load_distributed_tensors",
    "load_file",
    "read_metadata",
    "untrusted_content",
    "vet_checkpoint",
]

METADATA_FILE = ".metadata"  # torch.distributed.checkpoint's index
LIGHTNING_META_FILE = "meta.pt"  # Lightning's non-model state beside a distributed checkpoint

# What torch.distributed.checkpoint's index is made of: (module, name) pairs, nothing callable beyond these.
_METADATA_CLASSES = frozenset(
    [
        ("torch.distributed.checkpoint.metadata", name)
        for name in (
            "Metadata",
            "MetadataIndex",
            "StorageMeta",
            "TensorStorageMetadata",
            "TensorProperties",
            "ChunkStorageMetadata",
            "BytesStorageMetadata",
            "_MEM_FORMAT_ENCODING",  # an Enum: unpickled by value lookup
        )
    ]
    + [
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),  # a lookup of torch.strided & co. by name
        ("pathlib", "PosixPath"),  # StorageMeta.checkpoint_id
        ("pathlib", "PurePosixPath"),
        ("collections", "OrderedDict"),
    ]
)


class UntrustedCheckpointError(ValueError):
    """A checkpoint holds something other than data (or is not a checkpoint at all)."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_CLASSES:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a distributed checkpoint's index")


def untrusted_content(path: Path, what: str, exc: BaseException) -> UntrustedCheckpointError:
    """The error for a checkpoint part that is not data, naming the file and the first line of the cause."""
    first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return UntrustedCheckpointError(
        f"{path} {what}, which is refused (weights_only=True: a checkpoint is loaded as data only, tensors, "
        f"containers and plain values, so one shared by someone else cannot run code): {first_line}"
    )


def load_file(path: str | Path, *, mmap: bool = False) -> Any:
    """``torch.load`` of one checkpoint file with ``weights_only=True``; a clear error naming the file otherwise."""
    path = Path(path)
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as exc:
        raise untrusted_content(path, "holds objects other than tensors and plain values", exc) from None
    except (RuntimeError, EOFError, ValueError) as exc:
        raise UntrustedCheckpointError(f"{path} is not a readable checkpoint file: {exc}") from None


def read_metadata(directory: str | Path) -> Metadata:
    """The index of a distributed checkpoint, unpickled with only the classes torch's format needs."""
    path = Path(directory) / METADATA_FILE
    try:
        with open(path, "rb") as handle:
            metadata = _MetadataUnpickler(handle).load()
    except FileNotFoundError:
        raise UntrustedCheckpointError(
            f"{directory} is not a distributed checkpoint: it has no {METADATA_FILE}"
        ) from None
    except (pickle.UnpicklingError, AttributeError, TypeError, ValueError, EOFError, IndexError, KeyError) as exc:
        raise untrusted_content(path, "is not a distributed-checkpoint index of plain metadata", exc) from None
    if not isinstance(metadata, Metadata):
        raise UntrustedCheckpointError(f"{path} holds a {type(metadata).__name__}, not a distributed-checkpoint index")
    return metadata


def _check_storage_paths(directory: Path, metadata: Metadata) -> None:
    """Every file the index points at is a plain file directly inside the checkpoint directory."""
    for index, info in (metadata.storage_data or {}).items():
        name = getattr(info, "relative_path", None)
        if not isinstance(name, str) or PurePosixPath(name).name != name or name in ("", ".", ".."):
            raise UntrustedCheckpointError(
                f"{directory / METADATA_FILE} points entry {index.fqn!r} at {name!r}, outside the checkpoint directory"
            )
        target = directory / name
        if target.is_symlink() or not target.is_file():
            raise UntrustedCheckpointError(f"{target} (named by {directory / METADATA_FILE}) is not a plain file")


class DataOnlyReader(FileSystemReader):
    """torch's file-system reader, with the index read by ``read_metadata`` above."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:
            raise UntrustedCheckpointError(f"{self.path}: per-rank metadata files are not supported")
        metadata = read_metadata(Path(self.path))
        _check_storage_paths(Path(self.path), metadata)
        if getattr(metadata, "storage_meta", None) is None:  # what torch's reader does after its pickle.load
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class DataOnlyLoadPlanner(DefaultLoadPlanner):
    """The default load planner, except that non-tensor entries are unpickled with ``weights_only=True``."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as exc:
            raise untrusted_content(Path(f"entry {read_item.dest_index.fqn!r}"), "is not plain data", exc) from None
        super().load_bytes(read_item, _saved(loaded))


def _saved(obj: Any) -> io.BytesIO:
    """``obj`` re-serialised, for the parent planner to load back (it holds only data now)."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return buffer


def _read_bytes_entries(directory: Path, metadata: Metadata) -> None:
    """Load each non-tensor entry of the checkpoint with ``weights_only=True`` (and throw it away)."""
    entries = {fqn for fqn, md in metadata.state_dict_metadata.items() if isinstance(md, BytesStorageMetadata)}
    for index, info in (metadata.storage_data or {}).items():
        if index.fqn not in entries:
            continue
        if info.transform_descriptors:
            raise UntrustedCheckpointError(
                f"{directory / METADATA_FILE}: entry {index.fqn!r} is stored with transforms "
                f"{list(info.transform_descriptors)}, which this reader does not undo"
            )
        with open(directory / info.relative_path, "rb") as handle:
            handle.seek(info.offset)
            blob = handle.read(info.length)
        try:
            torch.load(io.BytesIO(blob), weights_only=True)
        except Exception as exc:  # noqa: BLE001 - any failure means "not plain data"
            raise untrusted_content(
                directory / info.relative_path, f"holds entry {index.fqn!r} that is not plain data", exc
            ) from None


def vet_checkpoint(path: str | Path) -> None:
    """Read every pickle of a checkpoint (file or distributed directory) the safe way; raise if any is not data.

    Tensor payloads of a distributed checkpoint are not read here (torch already loads those with
    ``weights_only=True``); a file checkpoint is memory-mapped, so vetting a large one costs little.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"ckpt_path={str(path)!r} does not exist")
    if not path.is_dir():
        load_file(path, mmap=True)
        return
    metadata = read_metadata(path)
    _check_storage_paths(path, metadata)
    _read_bytes_entries(path, metadata)
    if (path / LIGHTNING_META_FILE).is_file():
        load_file(path / LIGHTNING_META_FILE)


def load_distributed_tensors(directory: str | Path, prefix: str) -> dict[str, torch.Tensor]:
    """The tensors of a distributed checkpoint whose flattened names start with ``prefix`` (the prefix removed),
    read through ``DataOnlyReader`` in this one process."""
    import torch.distributed.checkpoint as dcp

    directory = Path(directory)
    metadata = read_metadata(directory)
    state = {
        fqn: torch.empty(md.size, dtype=md.properties.dtype)
        for fqn, md in metadata.state_dict_metadata.items()
        if fqn.startswith(prefix) and isinstance(md, TensorStorageMetadata)
    }
    if state:
        dcp.load(state, storage_reader=DataOnlyReader(directory), planner=DataOnlyLoadPlanner(), no_dist=True)
    return {fqn[len(prefix) :]: tensor for fqn, tensor in state.items()}
