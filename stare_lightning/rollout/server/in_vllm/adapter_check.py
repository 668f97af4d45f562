"""What a server's adapter route loads: a copy, made by the server itself, of an adapter checked through descriptors.

vLLM's ``POST /v1/load_lora_adapter`` takes a directory path, and the engine opens it by path after the request
came. A trainer that checked its directory in place cannot stop a user who may rename a directory above it from
exchanging it for a look-alike while the engine reads, and swapping it back afterwards: the server would serve the
other user's adapter under the trainer's name. The token guard (``auth.RequireToken``) therefore hands every such
request to ``CheckedAdapters.load`` first, which

- opens the directory once, without following a link at its name, and refuses it unless this server's user owns it
  and no group or other user may write it;
- opens ``adapter_config.json`` and ``adapter_model.safetensors`` relative to that descriptor, never through a link,
  as regular files of this user's, and reads them once;
- refuses a config that is not a JSON object and any tensor holding NaN or inf (served, it would sample garbage and
  leave non-finite values in reused KV-cache blocks, which later requests, the base model's included, read);
- writes what it read into a private directory of its own (``transfer_dir.TransferDirectory``: 0700, files created
  ``O_EXCL | O_NOFOLLOW``) and rewrites the request to load that copy.

The engine so loads exactly the bytes that were checked, whatever happens to the trainer's directory meanwhile.
A copy goes when its adapter is unloaded, and all of them when the server exits.

A trainer on another host sends the files inside the request instead of a path (``shared/adapter_wire.py``): their
digest under the server's secret is checked first, then the same checks, and the same private copy is loaded.
"""

from __future__ import annotations

import json
import os
import secrets
import stat

from stare_lightning.rollout.server.shared.adapter_wire import ADAPTER_FILES, InlineAdapterRefused, inline_adapter_files

__all__ = ["AdapterRefused", "CheckedAdapters", "checked_adapter_files", "adapter_name", "rewritten_load"]
_DIRECTORY_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK  # no link, and no blocking on a FIFO


class AdapterRefused(ValueError):
    """The adapter a load request names is not one this server may load; the message says why."""


def checked_adapter_files(path: str) -> dict[str, bytes]:
    """The bytes of the adapter files in directory ``path``, read through descriptors once every check passed."""
    if not isinstance(path, str) or not os.path.isabs(path):
        raise AdapterRefused(f"lora_path must be an absolute path, got {path!r}")
    try:
        folder = os.open(path, _DIRECTORY_FLAGS)
    except OSError as err:  # ELOOP: a link at the name; ENOTDIR: a file
        raise AdapterRefused(f"adapter directory {path} cannot be opened as a directory: {err.strerror}") from None
    try:
        _check_owned(path, os.fstat(folder), "adapter directory")
        files = {name: _read(folder, path, name) for name in ADAPTER_FILES}
    finally:
        os.close(folder)
    _check_contents(path, files)
    return files


def checked_inline_files(request: dict, token: str) -> dict[str, bytes]:
    """The adapter files a load ``request`` carries (``lora_files``), once their digest and contents pass."""
    try:
        files = inline_adapter_files(request, token)
    except InlineAdapterRefused as err:
        raise AdapterRefused(str(err)) from None
    _check_contents(f"the adapter sent as {request['lora_name']!r}", files)
    return files


def _check_contents(where: str, files: dict[str, bytes]) -> None:
    _check_config(where, files[ADAPTER_FILES[0]])
    _check_finite(where, files[ADAPTER_FILES[1]])


class CheckedAdapters:
    """One server's checked copies, by the adapter name they were loaded under. A copy made for a load request is
    pending until the engine has answered: kept if it loaded it, deleted if not."""

    def __init__(self) -> None:
        self._directory = None
        self._copies: dict[str, str] = {}
        self._pending: dict[str, str] = {}

    def load(self, name: str, files: dict[str, bytes]) -> str:
        """Copy the checked adapter ``files`` privately, and return the copy's path (what the engine loads)."""
        from stare_lightning.rollout.transfer_dir import TransferDirectory

        if self._directory is None:
            self._directory = TransferDirectory()  # 0700 in /dev/shm, removed at exit
        copy = f"adapter-{secrets.token_hex(8)}"
        with self._directory.create_directory(copy) as folder:
            for file, data in files.items():
                with folder.create(file) as out:
                    out.write(data)
        self._drop(self._pending.pop(name, None))
        self._pending[name] = copy
        return str(self._directory.path / copy)

    def settle(self, name: str, loaded: bool) -> None:
        """The engine answered the load of ``name``: keep its copy (replacing an earlier one) or delete it. A copy
        the engine refused never replaces the one it serves."""
        copy = self._pending.pop(name, None)
        if copy is None:
            return
        if not loaded:
            self._drop(copy)
            return
        self._drop(self._copies.get(name))
        self._copies[name] = copy

    def forget(self, name: str) -> None:
        """Delete the copy of the adapter unloaded as ``name`` (nothing if there is none)."""
        self._drop(self._copies.pop(name, None))

    def _drop(self, copy: str | None) -> None:
        if copy is not None and self._directory is not None:
            self._directory.delete(copy)


def rewritten_load(body: bytes, adapters: CheckedAdapters, token: str) -> bytes:
    """A ``load_lora_adapter`` request body naming the checked copy's path (pending in ``adapters`` until
    ``settle``) instead of ``lora_path``, or of the ``lora_files`` it carried (their digest keyed by ``token``)."""
    try:
        request = json.loads(body)
    except json.JSONDecodeError:
        raise AdapterRefused("the load_lora_adapter request is not JSON") from None
    if not isinstance(request, dict) or not isinstance(request.get("lora_name"), str):
        raise AdapterRefused("the load_lora_adapter request needs lora_name, and lora_path or lora_files")
    if ("lora_path" in request) == ("lora_files" in request):
        raise AdapterRefused("the load_lora_adapter request needs exactly one of lora_path and lora_files")
    if "lora_files" in request:
        files = checked_inline_files(request, token)
        request = {key: value for key, value in request.items() if key not in ("lora_files", "digest")}
    else:
        files = checked_adapter_files(request["lora_path"])
    request["lora_path"] = adapters.load(request["lora_name"], files)
    return json.dumps(request).encode()


def adapter_name(body: bytes) -> str | None:
    """The ``lora_name`` a load or unload request names, if it names one."""
    try:
        request = json.loads(body)
    except json.JSONDecodeError:
        return None
    name = request.get("lora_name") if isinstance(request, dict) else None
    return name if isinstance(name, str) else None


def _check_owned(path: str, status: os.stat_result, what: str) -> None:
    if status.st_uid != os.geteuid():
        raise AdapterRefused(
            f"{what} {path} is owned by uid {status.st_uid}, not by this server's user (uid {os.geteuid()}): an "
            "adapter must come from the trainer, which runs as the server's user"
        )
    mode = stat.S_IMODE(status.st_mode)
    if mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise AdapterRefused(f"{what} {path} is writable by other users (mode {mode:04o}): use a 0700 directory")


def _read(folder: int, path: str, name: str) -> bytes:
    try:
        fd = os.open(name, _FILE_FLAGS, dir_fd=folder)
    except OSError as err:
        raise AdapterRefused(f"adapter file {name} in {path} cannot be opened as a file: {err.strerror}") from None
    try:  # checked on the descriptor: a stream would refuse a directory naming the descriptor, not the file
        status = os.fstat(fd)
        if not stat.S_ISREG(status.st_mode):
            raise AdapterRefused(f"adapter file {name} in {path} is not a regular file")
        _check_owned(f"{path}/{name}", status, "adapter file")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    with os.fdopen(fd, "rb") as stream:
        return stream.read()


def _check_config(path: str, data: bytes) -> None:
    try:
        config = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError):
        config = None
    if not isinstance(config, dict):
        raise AdapterRefused(f"{path}/{ADAPTER_FILES[0]} is not a JSON object")


def _check_finite(path: str, data: bytes) -> None:
    import torch
    from safetensors.torch import load

    try:
        tensors = load(data)
    except Exception as err:  # safetensors raises its own error types for a malformed file
        raise AdapterRefused(f"{path}/{ADAPTER_FILES[1]} is not a safetensors file ({err})") from None
    for name, tensor in tensors.items():
        if tensor.is_floating_point() or tensor.is_complex():
            bad = int((~torch.isfinite(tensor)).sum())
            if bad:
                raise AdapterRefused(
                    f"{path}/{ADAPTER_FILES[1]}: tensor {name!r} holds {bad} non-finite values (NaN or inf); the "
                    "server keeps the adapters it has"
                )
