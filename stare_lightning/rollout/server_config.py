"""``ServerConfig``: the ``rollout.server`` config group (where ``rollout=server``'s vLLM servers run and how the
trainer reaches them), checked against the backend the run names."""

from __future__ import annotations

from dataclasses import dataclass, field

from stare_lightning.config.checks import choice, flag, number
from stare_lightning.rollout.backends import declared_backend

# rollout.server.transfer: how a push's weights reach the servers (trainer_side/placement.py picks for auto).
TRANSFER_MODES = ("auto", "files", "network")

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
# rollout.server.host for Unix sockets in a private directory: reachable by this user on this host only.
UNIX_HOST = "unix"
LOCAL_HOSTS = (UNIX_HOST, *LOOPBACK_HOSTS)


@dataclass
class ServerConfig:
    """``rollout.server``: generation on separate vLLM servers (``rollout.backend=server``, rollout/server/)."""

    launch: bool = True
    """Start the servers with the run and stop them with it; false: reach running servers at `urls`."""
    urls: list[str] = field(default_factory=list)
    """With launch=false: each server's base URL, e.g. http://rollout-node-1:8000."""
    count: int = 1
    """With launch=true: how many servers to start."""
    host: str = UNIX_HOST
    """With launch=true: where the servers listen. `unix`: a Unix socket each, in a directory only this user can
    enter (no other local user can connect); else an address for TCP, e.g. 127.0.0.1 (loopback, open to every
    local user) or 0.0.0.0 (every network)."""
    port: int = 0
    """With launch=true and a TCP host: the first server's port, the others following it; 0: free ports."""
    cpus: list[str] = field(default_factory=list)
    """With launch=true: the CPUs each server is pinned to, one entry per server (e.g. ["1"]); empty: no pinning."""
    gpus: list[str] = field(default_factory=list)
    """With launch=true: each server's CUDA_VISIBLE_DEVICES, one entry per server; empty: inherited."""
    gpu_memory_utilization: float | None = None
    """With launch=true on GPUs: the share of its GPU's memory each server takes; null: vLLM's default (0.9), for a
    server with a GPU of its own. Set it when a server shares its GPU with the trainer."""
    token_env: str = "STARE_LIGHTNING_SERVER_TOKEN"
    """The environment variable holding the servers' credential (launched servers get a fresh one when it is unset)."""
    startup_timeout: float = 600.0
    """Seconds a launched server may take to answer its health check."""
    request_timeout: float = 600.0
    """Seconds one request may take (a generation, a weight chunk) before the run stops naming the server."""
    chunk_mb: int = 64
    """Size of one packed chunk of a weight push."""
    transfer_dir: str | None = None
    """Where a push's chunk files go, a directory the servers read too: null is /dev/shm (servers on the trainer's
    host); for servers on other nodes, a directory on a file system every node mounts."""
    transfer: str = "auto"
    """How a push's weights reach the servers: `files` (chunk files in transfer_dir), `network` (trainer rank 0
    sends them to each server over a process group of its own, bound to the run's secret), or `auto`: the network
    when a server in urls is on another host and transfer_dir is unset, else files."""
    transfer_address: str | None = None
    """With the network transfer: this host's address the servers reach it at; null: the one on the route to the
    first server."""
    transfer_port: int = 0
    """With the network transfer: the port of the trainer's rendezvous store; 0: a free one."""

    def check(self, backend: str) -> None:
        p = "rollout.server."
        flag(f"{p}launch", self.launch)
        number(f"{p}count", self.count, low=1, integer=True)
        number(f"{p}port", self.port, low=0, high=65535, integer=True)
        number(f"{p}startup_timeout", self.startup_timeout, low=0.0, low_open=True)
        number(f"{p}request_timeout", self.request_timeout, low=0.0, low_open=True)
        number(f"{p}chunk_mb", self.chunk_mb, low=1, integer=True)
        self._check_transfer()
        if self.gpu_memory_utilization is not None:
            number(f"{p}gpu_memory_utilization", self.gpu_memory_utilization, low=0.0, high=1.0, low_open=True)
        if not isinstance(self.token_env, str) or not self.token_env.isidentifier():
            raise ValueError(f"{p}token_env={self.token_env!r} is not allowed: must be an environment variable name")
        for url in self.urls:
            unix = isinstance(url, str) and url.startswith(f"{UNIX_HOST}:/")
            if not unix and (
                not isinstance(url, str) or not url.startswith(("http://", "https://")) or url.count("/") > 3
            ):
                raise ValueError(
                    f"{p}urls entry {url!r} is not allowed: must be a base URL like http://host:8000, or "
                    "unix:/path/to/server.sock for a server on a Unix socket"
                )
        if self.host == UNIX_HOST and self.port != 0:
            raise ValueError(
                f"{p}port={self.port} does nothing with {p}host=unix: the servers listen on Unix sockets; set "
                f"{p}host to an address (e.g. 127.0.0.1) to listen on TCP ports"
            )
        entry = declared_backend(backend)
        if entry is None or not entry.server_settings:
            if self != ServerConfig():
                raise ValueError(
                    f"rollout.server settings do nothing with rollout.backend={backend}: they configure separate "
                    "generation servers; use rollout=server, or leave rollout.server at its defaults"
                )
            return
        if not self.launch:
            if not self.urls:
                raise ValueError(f"{p}launch=false needs {p}urls: the base URLs of the running servers")
            launched_only = {
                "count": 1,
                "host": UNIX_HOST,
                "port": 0,
                "cpus": [],
                "gpus": [],
                "gpu_memory_utilization": None,
            }
            for key, default in launched_only.items():
                if getattr(self, key) != default:
                    raise ValueError(
                        f"{p}{key} does nothing with {p}launch=false: it places servers the run starts; the "
                        f"servers at {p}urls were placed by whoever started them"
                    )
            return
        if self.urls:
            raise ValueError(f"{p}urls does nothing with {p}launch=true: set launch=false to use running servers")
        for key in ("cpus", "gpus"):
            if getattr(self, key) and len(getattr(self, key)) != self.count:
                raise ValueError(
                    f"{p}{key} has {len(getattr(self, key))} entries for {p}count={self.count}: give one per server"
                )

    def _check_transfer(self) -> None:
        p = "rollout.server."
        choice(f"{p}transfer", self.transfer, TRANSFER_MODES)
        number(f"{p}transfer_port", self.transfer_port, low=0, high=65535, integer=True)
        address = self.transfer_address
        if address is not None and (not isinstance(address, str) or not address.strip()):
            raise ValueError(f"{p}transfer_address={self.transfer_address!r} is not allowed: a host address or null")
        unix_urls = any(str(url).startswith(f"{UNIX_HOST}:") for url in self.urls)
        if self.transfer == "network" and (self.host == UNIX_HOST if self.launch else unix_urls):
            raise ValueError(
                f"{p}transfer=network cannot reach servers on Unix sockets (each runs in a network namespace of its "
                f"own, with no route to the trainer's rendezvous): set {p}host=127.0.0.1 (TCP) or {p}transfer=files"
            )
        if self.transfer == "files":
            for key, default in (("transfer_address", None), ("transfer_port", 0)):
                if getattr(self, key) != default:
                    raise ValueError(
                        f"{p}{key} does nothing with {p}transfer=files: it places the network transfer's "
                        f"rendezvous; set {p}transfer=network (or auto) to push over the network"
                    )
        if self.transfer == "network" and self.transfer_dir is not None:
            raise ValueError(
                f"{p}transfer_dir does nothing with {p}transfer=network: the weights go over the network, not "
                f"through files; drop it, or set {p}transfer=files"
            )

    def server_count(self) -> int:
        return self.count if self.launch else len(self.urls)
