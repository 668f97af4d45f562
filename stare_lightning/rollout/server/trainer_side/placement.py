"""Which transfer a run's pushes take (``rollout.server.transfer``), and where the network transfer listens.

``auto`` picks the network when a server is on another host, since nothing says a directory the trainer writes is one
that host can read, and files otherwise (shared memory on one host: a copy, no sockets). A server is on this host
when its URL is a Unix socket, a loopback address, this host's name, or a name that resolves to an address this host
can bind. A ``rollout.server.transfer_dir`` given with ``auto`` is a shared file system named on purpose: files then.
"""

from __future__ import annotations

import ipaddress
import socket
from urllib.parse import urlsplit

from stare_lightning.rollout.server_config import UNIX_HOST, ServerConfig

__all__ = ["network_address", "server_host", "transfer_mode"]

LOOPBACK_ADDRESS = "127.0.0.1"


def transfer_mode(server: ServerConfig) -> str:
    """``files`` or ``network``."""
    if server.transfer != "auto":
        return server.transfer
    if server.launch or server.transfer_dir is not None:
        return "files"
    return "network" if any(not _on_this_host(server_host(url)) for url in server.urls) else "files"


def server_host(url: str) -> str | None:
    """The host a server URL names (None: a Unix socket, on this host)."""
    if url.startswith(f"{UNIX_HOST}:"):
        return None
    return urlsplit(url).hostname


def network_address(server: ServerConfig, urls: list[str]) -> str:
    """The address the servers reach the trainer's rendezvous at: ``rollout.server.transfer_address``, else this
    host's address on the route to the first server on another host (loopback when all are on this one)."""
    if server.transfer_address is not None:
        return server.transfer_address
    from stare_lightning.rollout.server.shared.net_group import route_address

    for host in map(server_host, urls):
        if host is not None and not _on_this_host(host):
            return route_address(host)
    return LOOPBACK_ADDRESS


def _on_this_host(host: str | None) -> bool:
    if host is None or host in ("localhost", socket.gethostname(), socket.getfqdn()):
        return True
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except OSError:
        return False  # a name this host cannot resolve is not its own
    return any(_is_local(address) for address in addresses)


def _is_local(address: str) -> bool:
    if ipaddress.ip_address(address.split("%")[0]).is_loopback:
        return True
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        try:
            probe.bind((address, 0))  # only an address of one of this host's interfaces can be bound
        except OSError:
            return False
    return True
