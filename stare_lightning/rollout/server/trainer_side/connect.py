"""Reach the run's rollout servers: start them (``rollout.server.launch=true``, on rank 0) or take the given URLs,
check each answers before the first step, and hand every rank the same URLs and credential."""

from __future__ import annotations

import logging
import os
import secrets
import tempfile
from pathlib import Path

from stare_lightning import distributed
from stare_lightning.rollout.adapters import AdapterSync
from stare_lightning.rollout.backends import EngineContext
from stare_lightning.rollout.config import RolloutConfig
from stare_lightning.rollout.server.shared.token import check_token
from stare_lightning.rollout.server.trainer_side.client import RolloutServerError, ServerClient
from stare_lightning.rollout.server.trainer_side.engine import ServerRolloutEngine
from stare_lightning.rollout.server.trainer_side.placement import transfer_mode
from stare_lightning.rollout.server_config import UNIX_HOST, ServerConfig
from stare_lightning.rollout.transfer_dir import check_transfer_base, default_base

__all__ = ["answering_servers", "check_running_servers", "connect_servers", "launch_servers"]

logger = logging.getLogger(__name__)


def connect_servers(
    server: ServerConfig, model_dir: str, *, dtype: str, seed: int, log_dir: Path, adapters: AdapterSync | None = None
) -> ServerRolloutEngine:
    launched, urls, token, problem = None, list(server.urls), os.environ.get(server.token_env), None
    if server.transfer_dir is not None:
        check_transfer_base(server.transfer_dir)
    over_network = transfer_mode(server) == "network"  # placement.py; every rank decides the same
    if server.launch:
        if token is not None:
            check_token(token, f"${server.token_env}")
        token = token or secrets.token_urlsafe(32)
        if distributed.rank() == 0:
            try:
                launched = launch_servers(
                    server, model_dir, dtype=dtype, seed=seed, log_dir=log_dir, token=token, adapters=adapters
                )
                urls = list(launched.urls)
                print(f"rollout servers: {' '.join(urls)} (logs {log_dir})", flush=True)
            except Exception as error:  # every rank must hear of it, or the others wait at the gather below
                problem = str(error)
        urls, token, problem = distributed.all_gather_objects((urls, token, problem))[0]
    if problem:
        raise RolloutServerError(problem)
    try:
        clients = answering_servers(urls, token, server)
    except RolloutServerError:
        if launched is not None:
            launched.stop()
        raise
    # Rank 0's: every rank must name the adapters the same way.
    run_tag = distributed.all_gather_objects(f"run{secrets.token_hex(4)}")[0]
    # Adapters go inside their load requests (shared/adapter_wire.py); the gloo groups carry merged weights only.
    network = None
    if over_network and distributed.rank() == 0:
        if adapters is None:
            network = _network_push(server, clients, token)
        else:
            logger.info("adapters go to %d rollout server(s) inside their load requests", len(clients))
    return ServerRolloutEngine(
        clients,
        chunk_bytes=server.chunk_mb << 20,
        launched=launched,
        transfer_dir=server.transfer_dir,
        adapters=adapters,
        run_tag=run_tag,
        network=network,
        inline_adapters=over_network,
    )


def _network_push(server: ServerConfig, clients: list[ServerClient], token: str | None):
    """Rank 0's side of the network transfer."""
    from stare_lightning.rollout.server.trainer_side.net_push import NetworkPush
    from stare_lightning.rollout.server.trainer_side.placement import network_address

    if not token:  # a launched server always has one; servers reached by URL and no credential fail before this
        raise RolloutServerError(
            f"the network weight push binds its rendezvous to the servers' secret: set ${server.token_env}"
        )

    address = network_address(server, [client.url for client in clients])
    return NetworkPush(clients, token=token, address=address, port=server.transfer_port, timeout=server.request_timeout)


def build_server_engine(rollout: RolloutConfig, context: EngineContext) -> ServerRolloutEngine:
    """``rollout.backend=server``'s builder (``rollout/backends.py``): the servers launched (their logs in
    ``context.log_dir``) or reached, in the trainer's compute dtype."""
    return connect_servers(
        rollout.server,
        context.model_dir,
        dtype=context.dtype,
        seed=context.seed,
        log_dir=context.log_dir,
        adapters=context.adapters,
    )


def check_running_servers(rollout: RolloutConfig) -> None:
    """The server backend's preflight: with ``rollout.server.launch=false``, every server answers and takes the
    run's credential. Called before any model is prepared, so a wrong URL or token costs seconds, not a model's
    preparation."""
    if not rollout.server.launch:
        server = rollout.server
        answering_servers(list(server.urls), os.environ.get(server.token_env), server)


def answering_servers(urls: list[str], token: str | None, server: ServerConfig) -> list[ServerClient]:
    """A client per URL, once each server has answered its health check and taken the credential."""
    clients = [ServerClient(url, token=token, timeout=server.request_timeout) for url in urls]
    silent = [client.url for client in clients if not client.healthy()]
    if silent:
        raise RolloutServerError(
            f"rollout server {', '.join(silent)} does not answer its health check (GET /health): start it, or correct "
            "rollout.server.urls (docs/guides/servers.md)"
        )
    for client in clients:  # a credential the servers do not take is named now, not at the first push
        try:
            client.weight_version()
        except RolloutServerError as error:
            if error.status == 401:
                have = "is not the servers'" if token else "is unset"
                raise RolloutServerError(
                    f"rollout server {client.url} refused the run's credential: ${server.token_env} {have}; set it "
                    "to the secret the servers were started with (rollout.server.token_env names the variable)"
                ) from None
            raise
    return clients


def launch_servers(
    server: ServerConfig,
    model_dir: str,
    *,
    dtype: str,
    seed: int,
    log_dir: Path,
    token: str,
    adapters: AdapterSync | None = None,
):
    """Start ``server.count`` servers as ``rollout.server`` places them and wait until each is healthy; with
    ``adapters``, ready to load a LoRA policy's adapters at run time."""
    from stare_lightning.rollout.server.trainer_side.launch import LaunchedServers, ServerSpec, free_ports

    socket_dir = None
    if server.host == UNIX_HOST:
        # Made 0700 by mkdtemp: only this user (and root) may reach the sockets inside, so no other local user can
        # open, and hold, a connection to the servers. On /dev/shm: a socket path must stay under 108 bytes.
        socket_dir = Path(tempfile.mkdtemp(prefix="stare-lightning-servers-", dir=default_base()))
        ports, sockets = [0] * server.count, [str(socket_dir / f"{i}.sock") for i in range(server.count)]
    else:
        ports = [server.port + i for i in range(server.count)] if server.port else free_ports(server.count, server.host)
        sockets = [None] * server.count
    specs = [
        ServerSpec(
            port=port,
            host=server.host,
            cpus=server.cpus[i] if server.cpus else None,
            gpus=server.gpus[i] if server.gpus else None,
            uds=sockets[i],
        )
        for i, port in enumerate(ports)
    ]
    share = server.gpu_memory_utilization
    try:
        launched = LaunchedServers(
            model_dir,
            specs,
            log_dir=log_dir,
            token=token,
            dtype=dtype,
            seed=seed,
            startup_timeout=server.startup_timeout,
            extra_args=["--gpu-memory-utilization", str(share)] if share is not None else [],
            socket_dir=socket_dir,
            adapters=adapters,
        )
    except BaseException:
        if socket_dir is not None:  # from here on the servers' stop removes it
            socket_dir.rmdir()
        raise
    launched.start()
    return launched
