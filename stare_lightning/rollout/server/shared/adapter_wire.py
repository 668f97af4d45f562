"""A LoRA adapter carried inside its load request, for servers that do not see the trainer's file system.

vLLM loads an adapter from a directory on its own host. With the network transfer there is no directory both sides
see, so the trainer sends the adapter's two peft files in the authenticated ``POST /v1/load_lora_adapter`` request
itself, as ``lora_files`` (file name -> base64) with ``digest``: ``HMAC-SHA256(token, name + every file's name and
bytes)``. The server's guard (``in_vllm/adapter_check.py``) checks the digest, then the files as it checks a
directory's, and has the engine load a private copy it wrote itself.

Why not the weights' gloo group: an adapter is a few MB (SmolLM2-135M at rank 8 on every projection: 9.8 MB in
fp32), and vLLM's adapter loading starts in the API server from a path, while the group ends in the engine's worker
process.

This module imports neither vLLM nor torch: both sides use it.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
from collections.abc import Mapping

__all__ = ["ADAPTER_FILES", "InlineAdapterRefused", "inline_adapter_files", "inline_load_request"]

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")  # what vLLM reads of a peft adapter


class InlineAdapterRefused(ValueError):
    """An inline adapter that is malformed or not signed with the run's secret; the message says which."""


def inline_load_request(name: str, files: Mapping[str, bytes], token: str) -> dict:
    """The ``load_lora_adapter`` body that serves ``files`` (``ADAPTER_FILES``' bytes) as model ``name``."""
    return {
        "lora_name": name,
        "lora_files": {file: base64.b64encode(files[file]).decode() for file in ADAPTER_FILES},
        "digest": _digest(token, name, files),
    }


def inline_adapter_files(request: dict, token: str) -> dict[str, bytes]:
    """The files of an inline load ``request``, once their digest under ``token`` matches."""
    encoded, digest = request.get("lora_files"), request.get("digest")
    if not isinstance(encoded, dict) or sorted(encoded) != sorted(ADAPTER_FILES):
        names = sorted(encoded) if isinstance(encoded, dict) else type(encoded).__name__
        raise InlineAdapterRefused(f"lora_files has {names}; expected exactly {list(ADAPTER_FILES)}")
    files = {}
    for file, text in encoded.items():
        try:
            files[file] = base64.b64decode(text, validate=True)
        except (TypeError, ValueError, binascii.Error):
            raise InlineAdapterRefused(f"lora_files[{file!r}] is not base64") from None
    if not isinstance(digest, str) or not hmac.compare_digest(digest, _digest(token, request["lora_name"], files)):
        raise InlineAdapterRefused(
            "the adapter's digest does not match its files (not the trainer's bytes, or not the run's secret)"
        )
    return files


def _digest(token: str, name: str, files: Mapping[str, bytes]) -> str:
    mac = hmac.new(token.encode(), b"stare-lightning adapter\0" + name.encode() + b"\0", hashlib.sha256)
    for file in ADAPTER_FILES:
        mac.update(file.encode() + b"\0" + len(files[file]).to_bytes(8, "little"))
        mac.update(files[file])
    return mac.hexdigest()
