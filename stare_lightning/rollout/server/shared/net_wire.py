"""Weight pushes over the network: what both sides derive from the run's secret, and how a chunk is packed.

The trainer's rank 0 and each server's worker form a process group of two (``net_group.py``), found through a
``TCPStore`` the trainer hosts. Anyone who reaches that store can read and write its keys, so the group's keys lie
under a prefix only the holders of the run's secret can compute: ``HMAC-SHA256(token, "rendezvous" + nonce +
member)``, the nonce fresh for every run and sent to the server with the (authenticated) init request. A process
without the token writes its keys elsewhere and never meets the trainer.

Each chunk's tensors travel as one flat byte buffer over that group. Its description, sent over the authenticated
HTTP route as the chunk's ``update_info``, carries ``HMAC-SHA256(token, description + bytes)``: the server checks it
over the bytes it received before staging them, so bytes injected by whoever got onto the wire, or a description
that does not match them, refuse the round and the server keeps its weights.

This module imports neither vLLM nor ``torch.distributed``: both sides use it.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
from collections.abc import Iterable, Iterator

import torch

from stare_lightning.rollout.server.shared.transfer import TransferRefused, check_wire_dtype, parse_tensor_lists

__all__ = [
    "NET_INIT_KEY",
    "chunk_digest",
    "new_nonce",
    "pack_chunks",
    "parse_net_chunk",
    "rendezvous_prefix",
]

# init_info's key for the network transfer ({"network": {...}}); a file transfer's init_info has "directory".
NET_INIT_KEY = "network"
NET_UPDATE_KEYS = ("names", "dtype_names", "shapes", "tensor_sizes", "digest")
_NONCE_BYTES = 16
_DIGEST_HEX = 64


def new_nonce() -> str:
    return secrets.token_hex(_NONCE_BYTES)


def rendezvous_prefix(token: str, nonce: str, member: int) -> str:
    """The store prefix of server ``member``'s group in the run that drew ``nonce``: computable only with ``token``."""
    message = f"stare-lightning rendezvous\0{nonce}\0{member}".encode()
    return "sl-" + hmac.new(token.encode(), message, hashlib.sha256).hexdigest()


def chunk_digest(token: str, description: dict, payload: memoryview | bytes) -> str:
    """HMAC-SHA256 keyed by ``token`` over a chunk's description (without its digest) and its bytes."""
    header = json.dumps({key: description[key] for key in NET_UPDATE_KEYS[:-1]}, sort_keys=True).encode()
    mac = hmac.new(token.encode(), len(header).to_bytes(8, "little") + header, hashlib.sha256)
    mac.update(payload)  # hashlib releases the GIL on large buffers: servers are hashed beside the sends
    return mac.hexdigest()


def pack_chunks(
    weights: Iterable[tuple[str, torch.Tensor]], token: str, chunk_bytes: int
) -> Iterator[tuple[dict, torch.Tensor]]:
    """``(update_info, flat uint8 buffer)`` per chunk of about ``chunk_bytes`` (a larger tensor travels alone), the
    tensors back to back in the order named, the digest in the description."""
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    pending: list[tuple[str, torch.Tensor]] = []
    pending_bytes = 0
    for name, tensor in weights:
        check_wire_dtype(name, tensor)
        size = tensor.numel() * tensor.element_size()
        if pending and pending_bytes + size > chunk_bytes:
            yield _packed(pending, token)
            pending, pending_bytes = [], 0
        pending.append((name, tensor))
        pending_bytes += size
        if pending_bytes >= chunk_bytes:
            yield _packed(pending, token)
            pending, pending_bytes = [], 0
    if pending:
        yield _packed(pending, token)


def _packed(tensors: list[tuple[str, torch.Tensor]], token: str) -> tuple[dict, torch.Tensor]:
    sizes = [tensor.numel() * tensor.element_size() for _, tensor in tensors]
    buffer, offset = torch.empty(sum(sizes), dtype=torch.uint8), 0
    with torch.no_grad():
        for (_, tensor), size in zip(tensors, sizes):  # one copy, straight into the buffer that travels
            part = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
            buffer[offset : offset + size].copy_(part)
            offset += size
    info = {
        "names": [name for name, _ in tensors],
        "dtype_names": [str(tensor.dtype).removeprefix("torch.") for _, tensor in tensors],
        "shapes": [list(tensor.shape) for _, tensor in tensors],
        "tensor_sizes": sizes,
    }
    info["digest"] = chunk_digest(token, info, buffer.numpy().data)
    return info, buffer


def parse_net_chunk(update_info: object):
    """A network chunk's checked description (``transfer.ChunkSpec`` with no file) and its digest."""
    if not isinstance(update_info, dict):
        raise TransferRefused(f"update_info must be a JSON object, got {type(update_info).__name__}")
    digest = update_info.get("digest")
    if not isinstance(digest, str) or len(digest) != _DIGEST_HEX or not all(c in "0123456789abcdef" for c in digest):
        raise TransferRefused("update_info.digest must be the chunk's HMAC-SHA256 as 64 lowercase hex digits")
    return parse_tensor_lists(update_info, NET_UPDATE_KEYS, file=""), digest
