"""``python -m stare_lightning serve``: start the rollout servers a run would start, and keep them until stopped.

For runs whose servers live elsewhere (``rollout.server.launch=false``): on a rollout node, ``serve`` prepares the
same model the trainer will (the tiny model's cold start included), starts ``rollout.server.count`` stock vLLM
servers placed by ``rollout.server.host``, ``port``, ``cpus`` and ``gpus``, prints their URLs, and stops them on
Ctrl-C or SIGTERM. For a LoRA run (``model.lora.rank`` as the trainer's, ``rollout.lora_sync`` adapter or auto) the
servers start ready to load its adapters at run time. A server that dies ends ``serve`` with an error naming it, so
a scheduler sees it.

The credential: every route but ``/health`` needs the bearer token in ``$STARE_LIGHTNING_SERVER_TOKEN`` (or the
variable ``rollout.server.token_env`` names), the trainer's too; one shorter than 32 characters, or blank, is refused
before anything starts. On this host only (a Unix socket, loopback) a fresh one is made when the variable is unset
and written to ``<output_dir>/server-token`` (mode 0600), whose path is printed: logs are often readable by others,
so the token itself is never printed. Servers that listen on a network refuse to start without one set.

The run folder: an ``output_dir`` (or its ``servers/`` folder) owned by another user, or writable by others without
the sticky bit, is refused in one line before anything is written there; the token and the logs are created relative
to the checked folder, never through a link (``run_folder.py``). SIGINT and SIGTERM stop the servers from before the
first one is started, so a signal while one is still starting stops it too.
"""

from __future__ import annotations

import os
import secrets
import signal
import time
from pathlib import Path

from stare_lightning.rollout.backends import ROLLOUT_BACKENDS, SERVER_BACKEND
from stare_lightning.rollout.server.shared.token import check_token
from stare_lightning.rollout.server_config import LOCAL_HOSTS
from stare_lightning.run_folder import RunFolder

__all__ = ["serve", "serving_dtype"]


def serving_dtype(cfg) -> str:
    """The dtype the trainer computes in, as far as the config says it: FSDP2's ``param_dtype``, a ``bf16``/``16``
    precision, else the master weights' ``model.dtype``."""
    trainer = cfg.trainer or {}
    strategy = trainer.get("strategy")
    if isinstance(strategy, dict) and strategy.get("param_dtype"):
        return str(strategy["param_dtype"])
    precision = str(trainer.get("precision", ""))
    if precision.startswith("bf16"):
        return "bfloat16"
    if precision.startswith("16"):
        return "float16"
    return cfg.model.dtype


def serve(cfg) -> None:
    server = cfg.rollout.server
    if cfg.rollout.backend != SERVER_BACKEND or not server.launch:
        raise ValueError(
            "serve starts the servers of rollout=server itself: pass rollout=server and place them with "
            "rollout.server.count, host, port, cpus, gpus (rollout.server.launch must stay true)"
        )
    token = os.environ.get(server.token_env)
    if token is None and server.host not in LOCAL_HOSTS:
        raise ValueError(
            f"rollout.server.host={server.host} listens on a network: set {server.token_env} to a secret the "
            f"trainer's environment has too, e.g. export {server.token_env}=$(python -c 'import secrets; "
            "print(secrets.token_urlsafe(32))')"
        )
    if token is not None:
        check_token(token, f"${server.token_env}")
    # From here until the servers are stopped, SIGINT and SIGTERM end serve through its cleanup: a signal that comes
    # while a server is still starting stops it too, instead of leaving it running without its parent.
    previous = {signum: signal.signal(signum, _stop_serving) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        _serve(cfg, token)
    except _Stopped:
        pass
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


class _Stopped(BaseException):
    """SIGINT or SIGTERM: ``serve`` stops its servers and returns."""


def _stop_serving(signum, frame) -> None:
    for other in (signal.SIGINT, signal.SIGTERM):  # a second signal must not cut the servers' stop short
        signal.signal(other, signal.SIG_IGN)
    raise _Stopped(signum)


def _serve(cfg, token: str | None) -> None:
    from stare_lightning.rollout.lora_sync import adapter_sync
    from stare_lightning.rollout.server.trainer_side.client import RolloutServerError
    from stare_lightning.rollout.server.trainer_side.connect import launch_servers
    from stare_lightning.train import prepare_model

    server = cfg.rollout.server
    with RunFolder(cfg.output_dir) as output_dir:  # checked before anything is written in it
        if token is None:
            token = secrets.token_urlsafe(32)
            path = output_dir.write_private("server-token", token)
            print(
                f"the servers' credential is in {path} (mode 0600): export {server.token_env}=$(cat {path}) where "
                "the trainer runs",
                flush=True,
            )
    model_dir = prepare_model(cfg)
    log_dir = Path(cfg.output_dir) / "servers"
    adapters = adapter_sync(cfg.rollout, cfg.model.lora, ROLLOUT_BACKENDS[SERVER_BACKEND])  # a LoRA run's
    launched = None
    try:
        launched = launch_servers(
            server,
            str(model_dir),
            dtype=serving_dtype(cfg),
            seed=cfg.seed,
            log_dir=log_dir,
            token=token,
            adapters=adapters,
        )
        print(f"rollout servers: {' '.join(launched.urls)} (model {model_dir}; logs {log_dir})", flush=True)
        while True:
            dead = launched.dead()
            if dead:
                url, code = dead[0]
                raise RolloutServerError(
                    f"rollout server {url} exited with code {code} (log: {launched.log_path(url)})"
                )
            time.sleep(1.0)
    finally:
        if launched is not None:
            launched.stop()
