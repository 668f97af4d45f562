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
"""

from __future__ import annotations

import os
import secrets
import signal
import tempfile
import time
from pathlib import Path

from stare_lightning.rollout.backends import ROLLOUT_BACKENDS, SERVER_BACKEND
from stare_lightning.rollout.config import LOCAL_HOSTS
from stare_lightning.rollout.server.auth import check_token

__all__ = ["serve", "serving_dtype", "write_private"]


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


def write_private(path: Path, text: str) -> Path:
    """Write ``text`` to ``path`` readable by this user only (mode 0600 from its creation: a temporary file in the
    same directory, renamed over ``path``, so no moment exists where it is readable by others and no link is
    followed)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temporary = tempfile.mkstemp(prefix=f".{path.name}-", dir=path.parent)  # mkstemp creates it 0600
    try:
        with os.fdopen(fd, "w") as out:
            out.write(text + "\n")
        os.replace(temporary, path)
    except BaseException:
        os.unlink(temporary)
        raise
    return path


def serve(cfg) -> None:
    from stare_lightning.rollout.factory import adapter_sync
    from stare_lightning.rollout.server.client import RolloutServerError
    from stare_lightning.rollout.server.connect import launch_servers
    from stare_lightning.train import prepare_model

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
    else:
        token = secrets.token_urlsafe(32)
        path = write_private(Path(cfg.output_dir) / "server-token", token)
        print(
            f"the servers' credential is in {path} (mode 0600): export {server.token_env}=$(cat {path}) where the "
            "trainer runs",
            flush=True,
        )
    model_dir = prepare_model(cfg)
    log_dir = Path(cfg.output_dir) / "servers"
    adapters = adapter_sync(cfg.rollout, cfg.model.lora, ROLLOUT_BACKENDS[SERVER_BACKEND])  # a LoRA run's
    launched = launch_servers(
        server, str(model_dir), dtype=serving_dtype(cfg), seed=cfg.seed, log_dir=log_dir, token=token,
        adapters=adapters,
    )  # fmt: skip
    stop = []
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.append(True))
    print(f"rollout servers: {' '.join(launched.urls)} (model {model_dir}; logs {log_dir})", flush=True)
    try:
        while not stop:
            dead = launched.dead()
            if dead:
                url, code = dead[0]
                raise RolloutServerError(
                    f"rollout server {url} exited with code {code} (log: {launched.log_path(url)})"
                )
            time.sleep(1.0)
    finally:
        launched.stop()
