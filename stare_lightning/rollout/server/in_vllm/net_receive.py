"""The server's side of a network weight push: join the trainer's group, receive each chunk's bytes, check their
digest and values, and hand back the tensors to stage (``transfer_engine.py`` applies a round only once all of it is
in, so a refusal here leaves the served weights as they were).

The init request (authenticated, like every route but the health check) carries the trainer's store address and
port, the run's nonce, this server's member number and the timeout; the group's prefix and every digest's key come
from the server's own copy of the secret (``$STARE_LIGHTNING_SERVER_TOKEN``), which never travels for this.
"""

from __future__ import annotations

import hmac
import os
import re

import torch

from stare_lightning.rollout.server.shared.net_group import WORKER_RANK, TransferGroup, connect_store, route_address
from stare_lightning.rollout.server.shared.net_wire import chunk_digest, parse_net_chunk, rendezvous_prefix
from stare_lightning.rollout.server.shared.token import TOKEN_ENV
from stare_lightning.rollout.server.shared.transfer import DTYPES, ChunkSpec, TransferRefused, refuse_non_finite

__all__ = ["NetworkReceiver"]

INIT_KEYS = ("address", "port", "nonce", "member", "timeout_s")
_NONCE = re.compile(r"[0-9a-f]{32}")
_MAX_TIMEOUT_S = 24 * 3600.0


class NetworkReceiver:
    """One worker's end of the trainer's transfer group (joined in the constructor; blocks until the trainer is there
    too, or the timeout passes)."""

    def __init__(self, init: object) -> None:
        address, port, nonce, member, timeout = _parse_init(init)
        token = os.environ.get(TOKEN_ENV, "")
        if not token:
            raise TransferRefused(f"a network weight push needs the server's secret in ${TOKEN_ENV}; it is unset")
        self._token = token
        try:
            store = connect_store(address, port, timeout)
            prefix = rendezvous_prefix(token, nonce, member)
            self._group = TransferGroup(store, prefix, WORKER_RANK, route_address(address), timeout)
        except (RuntimeError, OSError) as err:  # torch's store and gloo errors are RuntimeErrors
            raise TransferRefused(
                f"joining the trainer's weight-transfer group at {address}:{port} failed within {timeout:g} s: {err}"
            ) from None
        self.where = f"{address}:{port}"

    def receive(self, update_info: dict) -> tuple[ChunkSpec, dict[str, torch.Tensor]]:
        """The chunk ``update_info`` describes, received from the trainer and checked: its digest over the bytes that
        arrived, then every tensor finite."""
        spec, digest = parse_net_chunk(update_info)
        buffer = torch.empty(spec.total_bytes, dtype=torch.uint8)
        if spec.total_bytes:
            try:
                self._group.receive(buffer)
            except RuntimeError as err:
                raise TransferRefused(
                    f"receiving a weight chunk from the trainer at {self.where} failed ({err}); the model keeps its "
                    "weights"
                ) from None
        received = chunk_digest(self._token, update_info, buffer.numpy().data)
        if not hmac.compare_digest(received, digest):
            raise TransferRefused(
                "a weight chunk's bytes do not match the digest the trainer sent for them (not the trainer's bytes, "
                "or not the run's secret): the round is refused and the model keeps its weights"
            )
        tensors, offset = {}, 0
        for name, dtype, shape, size in zip(spec.names, spec.dtype_names, spec.shapes, spec.sizes):
            tensor = torch.empty(shape, dtype=DTYPES[dtype])  # its own storage: a slice may be misaligned
            tensor.reshape(-1).view(torch.uint8).copy_(buffer[offset : offset + size])
            refuse_non_finite(tensor, name, "a network chunk")
            tensors[name] = tensor
            offset += size
        return spec, tensors


def _parse_init(init: object) -> tuple[str, int, str, int, float]:
    if not isinstance(init, dict) or set(init) != set(INIT_KEYS):
        keys = sorted(init) if isinstance(init, dict) else type(init).__name__
        raise TransferRefused(f"init_info.network has {keys}; expected exactly {list(INIT_KEYS)}")
    address, port, nonce, member, timeout = (init[key] for key in INIT_KEYS)
    if not isinstance(address, str) or not address or len(address) > 255:
        raise TransferRefused(f"init_info.network.address {address!r} is not a host address")
    if not _is_int(port) or not 0 < port < 65536:
        raise TransferRefused(f"init_info.network.port {port!r} is not a port number")
    if not isinstance(nonce, str) or not _NONCE.fullmatch(nonce):
        raise TransferRefused("init_info.network.nonce must be 32 lowercase hex digits")
    if not _is_int(member) or member < 0:
        raise TransferRefused(f"init_info.network.member {member!r} is not a non-negative integer")
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not 0 < timeout <= _MAX_TIMEOUT_S:
        raise TransferRefused(f"init_info.network.timeout_s {timeout!r} is not a number of seconds in (0, 86400]")
    return address, port, nonce, member, float(timeout)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
