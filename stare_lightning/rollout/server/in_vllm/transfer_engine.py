"""The server side of the ``stare_lightning`` weight-transfer backend: a vLLM ``WeightTransferEngine`` that takes
each chunk of a round either from a file (``transfer.py``, ``init_info = {"directory": ...}``) or from the trainer
over the network (``net_receive.py``, ``init_info = {"network": {...}}``), and applies a whole round at once. The
trainer picks the transfer at its init request, so a server started by ``serve`` serves either.

A round is atomic. ``update_weights`` checks each chunk (its description, the file, every tensor's name and shape
against the served checkpoint) and stages copies of its tensors; only ``finish_weight_update`` touches the model,
through vLLM's layerwise reload (the same steps as ``reload_weights(is_checkpoint_format=True)``), and only when
the round carries every tensor of the checkpoint exactly once. An interrupted layerwise reload leaves layers on
the meta device and kills the engine at its next forward, so every refusal happens before it starts: a refused
chunk or round leaves the model serving its previous weights. A chunk holding NaN or inf is refused too: served, it
would sample garbage under the new version and leave non-finite values in reused KV-cache blocks.

The transfer directory must belong to this server's user and be closed to everyone else (the trainer runs as that
user); it is opened once, and every chunk relative to it, so a path renamed or replaced later changes nothing.

After a refused ``finish_weight_update`` vLLM still counts the round as open; a second ``finish_weight_update``
closes it without touching the model.

Imported only in vLLM's processes (``plugin.py`` registers it by module path).
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.logger import init_logger
from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

from stare_lightning.rollout.server.shared.transfer import (
    DTYPES,
    ChunkSpec,
    TransferRefused,
    checkpoint_shapes,
    parse_chunk,
    refuse_non_finite,
)
from stare_lightning.run_folder import own_regular_file

# Under vLLM's logger, whose handler writes to the server's log: how a server takes its weights is said there.
logger = init_logger(f"vllm.{__name__}")
_MISSING_SHOWN = 10


@dataclass
class TransferInitInfo(WeightTransferInitInfo):
    directory: str | None = None
    network: dict | None = None  # net_receive.INIT_KEYS


@dataclass
class FileUpdateInfo(WeightTransferUpdateInfo):
    file: str
    names: list[str] = field(default_factory=list)
    dtype_names: list[str] = field(default_factory=list)
    shapes: list[list[int]] = field(default_factory=list)
    tensor_sizes: list[int] = field(default_factory=list)


class CheckedWeightTransferEngine(WeightTransferEngine[TransferInitInfo, FileUpdateInfo]):
    init_info_cls = TransferInitInfo
    update_info_cls = FileUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self._directory: str | None = None
        self._directory_fd: int | None = None
        self._receiver = None  # a net_receive.NetworkReceiver once a network init succeeded
        self._expected: dict[str, tuple[int, ...]] | None = None
        self._staged: dict[str, torch.Tensor] = {}
        self._round_refused = False
        self._broken: str | None = None

    def init_transfer_engine(self, init_info: TransferInitInfo) -> None:
        if self._staged:
            raise TransferRefused("init_weight_transfer_engine during a weight update: finish the round first")
        if (init_info.directory is None) == (init_info.network is None):
            raise TransferRefused("init_info names exactly one of 'directory' (files) and 'network'")
        if init_info.network is not None:
            self._init_network(init_info.network)
            return
        directory = init_info.directory
        if not isinstance(directory, str) or not os.path.isabs(directory):
            raise TransferRefused(f"init_info.directory must be an absolute path, got {directory!r}")
        try:
            fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as err:
            raise TransferRefused(f"transfer directory {directory} cannot be opened as a directory: {err}") from None
        try:
            status = os.fstat(fd)
            if status.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
                raise TransferRefused(
                    f"transfer directory {directory} is writable by other users (mode "
                    f"{stat.S_IMODE(status.st_mode):o}); chunk files must come from the trainer alone: use a 0700 "
                    "directory"
                )
            if status.st_uid != os.geteuid():
                # Mode bits say nothing of who made it: another user's directory holds that user's chunks.
                raise TransferRefused(
                    f"transfer directory {directory} is owned by uid {status.st_uid}, not by this server's user "
                    f"(uid {os.geteuid()}): chunk files must come from the trainer, which runs as the server's user"
                )
            expected = self._expected if self._expected is not None else checkpoint_shapes(self.model_config.model)
        except BaseException:
            os.close(fd)
            raise
        self._close_directory()
        self._receiver = None
        self._directory, self._directory_fd, self._expected = directory, fd, expected
        logger.info("Weight pushes read chunk files from %s (%d checkpoint tensors)", directory, len(expected))

    def _init_network(self, init: object) -> None:
        from stare_lightning.rollout.server.in_vllm.net_receive import NetworkReceiver

        if self.parallel_config.world_size > 1 or self.parallel_config.data_parallel_size > 1:
            raise TransferRefused(
                "a network weight push reaches one worker per server; this server runs "
                f"{self.parallel_config.world_size} per engine and {self.parallel_config.data_parallel_size} engines "
                "(tensor, pipeline or data parallel): push through files (rollout.server.transfer=files)"
            )
        expected = self._expected if self._expected is not None else checkpoint_shapes(self.model_config.model)
        receiver = NetworkReceiver(init)  # blocks until the trainer's side has joined too
        self._close_directory()
        self._receiver, self._expected = receiver, expected
        logger.info("Weight pushes come over the network from %s (%d tensors)", receiver.where, len(expected))

    def start_weight_update(self) -> None:
        if self._broken:
            raise RuntimeError(self._broken)
        if self._directory_fd is None and self._receiver is None:
            raise TransferRefused("start_weight_update before init_weight_transfer_engine")
        self._staged, self._round_refused = {}, False

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class also synchronizes the accelerator, which raises where there is none (CPU).
        try:
            if self._receiver is not None:
                spec, tensors = self._receiver.receive(update_info)
                self._checked(spec)
                self._staged.update(tensors)
            else:
                self._stage(self._checked(parse_chunk(update_info)))
        except BaseException:
            self._staged = {}  # vLLM ends the round on a failed update: nothing of it may reach the model
            raise

    def receive_weights(self, update_info: FileUpdateInfo) -> None:
        self.update_weights(vars(update_info))

    def finish_weight_update(self) -> None:
        if self._broken:
            raise RuntimeError(self._broken)
        staged, self._staged = self._staged, {}
        if not staged and self._round_refused:
            self._round_refused = False  # closes the refused round; the model keeps its weights
            return
        assert self._expected is not None
        missing = sorted(set(self._expected) - set(staged))
        if missing:
            self._round_refused = True
            shown = ", ".join(missing[:_MISSING_SHOWN]) + (" ..." if len(missing) > _MISSING_SHOWN else "")
            raise TransferRefused(
                f"weight round refused, the model keeps its weights: it lacks {len(missing)} of the checkpoint's "
                f"{len(self._expected)} tensors ({shown}); a round carries every tensor. Call "
                "finish_weight_update again to close the round"
            )
        self._apply(list(staged.items()))

    def shutdown(self) -> None:
        self._staged = {}
        self._receiver = None
        self._close_directory()

    def _checked(self, chunk: ChunkSpec) -> ChunkSpec:
        """The chunk's tensors against the checkpoint and this round's earlier chunks."""
        if (self._directory_fd is None and self._receiver is None) or self._expected is None:
            raise TransferRefused("update_weights before init_weight_transfer_engine")
        for name, shape in zip(chunk.names, chunk.shapes):
            if name not in self._expected:
                raise TransferRefused(f"tensor {name!r} is not in the served checkpoint {self.model_config.model}")
            if shape != self._expected[name]:
                raise TransferRefused(
                    f"tensor {name!r} has shape {list(shape)}; the served checkpoint's is {list(self._expected[name])}"
                )
            if name in self._staged:
                raise TransferRefused(f"tensor {name!r} came twice in one round")
        return chunk

    def _stage(self, chunk: ChunkSpec) -> None:
        """Copy the chunk's tensors out of its file (only a regular file directly in the transfer directory)."""
        try:
            # No symbolic links, and no blocking on a FIFO; dir_fd keeps the name inside the directory.
            flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
            fd = os.open(chunk.file, flags, dir_fd=self._directory_fd)
        except FileNotFoundError as err:
            raise TransferRefused(f"chunk file {chunk.file!r} does not exist in {self._directory}") from err
        except OSError as err:  # ELOOP: the name is a symbolic link
            raise TransferRefused(
                f"chunk file {chunk.file!r} in {self._directory} cannot be opened as a file: {err}"
            ) from err
        # Checked on the descriptor before it becomes a stream: a stream refuses a directory with an error that names
        # the descriptor's number, not the chunk.
        status = own_regular_file(
            fd, lambda what: TransferRefused(f"chunk file {chunk.file!r} in {self._directory} {what}")
        )
        with os.fdopen(fd, "rb", buffering=0) as stream:
            if status.st_size != chunk.total_bytes:
                raise TransferRefused(
                    f"chunk file {chunk.file!r} holds {status.st_size} bytes; its tensors' sizes add up to "
                    f"{chunk.total_bytes}"
                )
            staged = {}
            for name, dtype, shape in zip(chunk.names, chunk.dtype_names, chunk.shapes):
                tensor = torch.empty(shape, dtype=DTYPES[dtype])
                _read_exactly(stream, tensor.reshape(-1).view(torch.uint8).numpy(), chunk.file)
                refuse_non_finite(tensor, name, f"chunk file {chunk.file!r}")
                staged[name] = tensor
        self._staged.update(staged)

    def _apply(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        model = self.model
        initialize_layerwise_reload(model)
        try:
            with torch.no_grad():
                model.load_weights(weights)
            finalize_layerwise_reload(model, self.model_config)
        except BaseException as err:
            # Some layers may hold new weights, some none: nothing here can be served any more.
            self._broken = (
                f"loading a checked weight round failed ({type(err).__name__}: {err}); the model is half loaded: "
                "restart this server"
            )
            raise RuntimeError(self._broken) from err

    def _close_directory(self) -> None:
        if self._directory_fd is not None:
            os.close(self._directory_fd)
        self._directory, self._directory_fd = None, None


def _read_exactly(stream, buffer, file: str) -> None:
    view, done = memoryview(buffer).cast("B"), 0
    while done < len(view):
        count = stream.readinto(view[done:])
        if not count:
            raise TransferRefused(f"chunk file {file!r} ended early (it changed while being read)")
        done += count
