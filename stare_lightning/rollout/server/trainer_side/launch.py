"""Start and stop stock vLLM servers for ``rollout=server``: one process group per server, its output in a log file,
its weight-transfer backend and token guard configured, ready once ``GET /health`` answers 200.

A server listens on TCP (``host``, ``port``) or, for servers only the trainer on this host talks to, on a Unix socket
(``uds``, vLLM's ``--uds``) in a directory of mode 0700: the kernel then keeps every other local user off it (the
stock server has no timeout for headers that never finish, so anyone who can connect can hold its connections). Such a
server runs in a network namespace of its own (``private_net.py``), so its engine's internal TCP ports are out of
other users' reach too. Logs are opened relative to the checked run folder, never through a link (``run_folder.py``).
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from stare_lightning.rollout.adapters import AdapterSync
from stare_lightning.rollout.server.shared.engine_start import FORK_ENGINE_CORE_ENV
from stare_lightning.rollout.server.shared.token import TOKEN_ENV, check_token
from stare_lightning.rollout.server.shared.transfer import BACKEND
from stare_lightning.rollout.server.trainer_side import http, private_net
from stare_lightning.run_folder import RunFolder

__all__ = ["LaunchedServers", "ServerSpec", "ServerStartError", "free_ports"]

MIDDLEWARE = "stare_lightning.rollout.server.in_vllm.auth.RequireToken"
_CPU_KV_CACHE_BYTES = 1 << 30  # as the colocated engine's CPU default (rollout/vllm_settings.py)
_STOP_GRACE_S = 20.0
_POLL_S = 0.5
_LOG_TAIL_LINES = 30


@dataclass(frozen=True)
class ServerSpec:
    """Where one server listens and what it may use."""

    port: int
    host: str = "127.0.0.1"
    cpus: str | None = None  # CPU list for its affinity and vLLM's OpenMP binding, e.g. "1" or "0-3"
    gpus: str | None = None  # its CUDA_VISIBLE_DEVICES
    uds: str | None = None  # a Unix socket path to listen on instead of host and port

    @property
    def url(self) -> str:
        if self.uds is not None:
            return http.UNIX_SCHEME + self.uds
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def name(self) -> str:
        """What its log file is named after: the port, or the socket's file name."""
        return os.path.splitext(os.path.basename(self.uds))[0] if self.uds is not None else str(self.port)


class ServerStartError(RuntimeError):
    """A server did not come up: the message names its URL and log file, with the log's last lines."""


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` distinct ports the kernel reports free on ``host`` now (held together while chosen, so distinct)."""
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket(_family(host), socket.SOCK_STREAM)
            sockets.append(sock)
            sock.bind((host, 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


class LaunchedServers:
    """Stock vLLM servers on one model, started together (``start``) and stopped together (``stop``, also at exit)."""

    def __init__(
        self,
        model_dir,
        specs: Sequence[ServerSpec],
        *,
        log_dir: Path,
        token: str,
        dtype: str = "float32",
        seed: int = 0,
        max_model_len: int | None = None,
        kv_cache_memory_bytes: int | None = None,
        startup_timeout: float = 600.0,
        extra_args: Sequence[str] = (),
        socket_dir: Path | None = None,
        adapters: AdapterSync | None = None,
    ) -> None:
        if not specs:
            raise ValueError("LaunchedServers needs at least one ServerSpec")
        check_token(token, "the servers' token")
        ports = [spec.uds or (spec.host, spec.port) for spec in specs]
        if len(set(ports)) != len(ports):
            raise ValueError(f"two servers on the same address: {ports}")
        self.model_dir, self.specs, self.log_dir, self.token = str(model_dir), list(specs), Path(log_dir), token
        self.dtype, self.seed, self.max_model_len = dtype, seed, max_model_len
        self.kv_cache_memory_bytes, self.startup_timeout, self.extra_args = (
            kv_cache_memory_bytes,
            startup_timeout,
            list(extra_args),
        )
        self.socket_dir = socket_dir  # the private directory of the servers' Unix sockets, removed at stop
        self.adapters = adapters  # LoRA adapters loaded at run time (rollout.lora_sync=adapter), or None
        self.urls: list[str] = [spec.url for spec in self.specs]
        self._processes: dict[str, subprocess.Popen] = {}
        self._logs: RunFolder | None = None

    def __enter__(self) -> LaunchedServers:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def log_path(self, url: str) -> Path:
        spec = self.specs[self.urls.index(url)]
        return self.log_dir / f"server-{spec.name}.log"

    def command(self, spec: ServerSpec) -> list[str]:
        """The server's command line."""
        args = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model_dir]
        args += ["--uds", spec.uds] if spec.uds is not None else ["--host", spec.host, "--port", str(spec.port)]
        args += ["--dtype", self.dtype, "--seed", str(self.seed)]
        args += ["--logprobs-mode", "processed_logprobs", "--generation-config", "vllm"]
        args += ["--weight-transfer-config", json.dumps({"backend": BACKEND}), "--enable-scale-out"]
        args += ["--middleware", MIDDLEWARE, "--disable-uvicorn-access-log"]
        if self.max_model_len is not None:
            args += ["--max-model-len", str(self.max_model_len)]
        kv_cache = self.kv_cache_memory_bytes
        if _on_cpu(spec):
            # Chunked prefill off: vLLM cannot rewind a seeded CPU generator (rollout/vllm_settings.py).
            args += ["--enforce-eager", "--no-enable-chunked-prefill"]
            kv_cache = _CPU_KV_CACHE_BYTES if kv_cache is None else kv_cache
        if kv_cache is not None:
            args += ["--kv-cache-memory-bytes", str(int(kv_cache))]
        if self.adapters is not None:
            args += self.adapters.server_args()
        return args + self.extra_args

    def environment(self, spec: ServerSpec) -> dict[str, str]:
        env = dict(os.environ)
        env.update({"VLLM_SERVER_DEV_MODE": "1", TOKEN_ENV: self.token})
        # The API server runs its engine in a process of its own whatever this says. On a GPU that process holds the
        # one worker too; on a CPU vLLM starts a third process for it unless this is 0: one more interpreter to
        # import vLLM into (about 7 s of CPU) for nothing a single worker needs (a parent that runs vLLM in-process
        # may have set it either way).
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if _on_cpu(spec) else "1"
        if self.adapters is not None:  # the load and unload routes exist only with this set
            env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
        env.pop(FORK_ENGINE_CORE_ENV, None)
        if spec.gpus is not None:
            env["CUDA_VISIBLE_DEVICES"] = spec.gpus
        if _on_cpu(spec):
            env[FORK_ENGINE_CORE_ENV] = "1"  # not a second import of vLLM (shared/engine_start.py)
            env["VLLM_USE_AOT_COMPILE"] = "0"
            # A CPU server runs eagerly (--enforce-eager above): nothing to compile but one sampler helper, which
            # would cost each start about 2.5 s of CPU (rollout/vllm_process.py, sampler_helpers_eager).
            env["TORCH_COMPILE_DISABLE"] = "1"
            if spec.cpus is not None:
                env["VLLM_CPU_OMP_THREADS_BIND"] = spec.cpus  # vLLM's own binding would pick a NUMA node's cores
        return env

    def start(self) -> None:
        """Start every server, then wait until each answers ``GET /health``; on a failure stop them all and raise
        ``ServerStartError``."""
        if self._processes:
            raise RuntimeError("these servers are already started")
        # Checked before anything is written: the run's folder and its log folder are this user's alone.
        with RunFolder(self.log_dir.parent) as parent:
            self._logs = parent.folder(self.log_dir.name)
        atexit.register(self.stop)
        try:
            for spec, url in zip(self.specs, self.urls):
                self._check_port(spec, url)
                self._processes[url] = self._spawn(spec, url)
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """TERM each server's process group, KILL what is left after a grace period. Idempotent."""
        processes, self._processes = self._processes, {}
        atexit.unregister(self.stop)
        for process in processes.values():
            _signal_group(process, signal.SIGTERM)
        deadline = time.monotonic() + _STOP_GRACE_S
        for process in processes.values():
            try:
                process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            # The group goes too: workers the server started may outlive it.
            _signal_group(process, signal.SIGKILL)
            process.wait()
        if self.socket_dir is not None and not self._processes:
            shutil.rmtree(self.socket_dir, ignore_errors=True)
        if self._logs is not None:
            self._logs.close()
            self._logs = None

    def dead(self) -> list[tuple[str, int]]:
        """``(url, returncode)`` of each started server whose process has exited."""
        return [(url, process.returncode) for url, process in self._processes.items() if process.poll() is not None]

    def _check_port(self, spec: ServerSpec, url: str) -> None:
        if spec.uds is not None:
            if os.path.lexists(spec.uds):
                raise ServerStartError(f"rollout server {url} cannot listen: {spec.uds} exists")
            return
        with socket.socket(_family(spec.host), socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server binds
            try:
                sock.bind((spec.host, spec.port))
            except OSError as err:
                raise ServerStartError(f"rollout server {url} cannot listen on port {spec.port}: {err}") from err

    def _spawn(self, spec: ServerSpec, url: str) -> subprocess.Popen:
        cpus = _parse_cpus(spec.cpus) if spec.cpus is not None else None
        # A server on a Unix socket needs no network: its engine's TCP ports go into a namespace of its own.
        why_not = private_net.available() if spec.uds is not None else "it listens on TCP"
        with self._logs.append(self.log_path(url).name) as log:
            log.write(f"# rollout server {url}\n".encode())  # which server this log is (a socket's name says little)
            if why_not is not None:
                log.write(f"# its engine's TCP ports are on the host's network ({why_not})\n".encode())
            log.flush()
            return subprocess.Popen(
                self.command(spec),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.environment(spec),
                start_new_session=True,  # its own process group: stop() reaches the engine and worker processes
                preexec_fn=private_net.preexec(why_not is None, cpus),
            )

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        waiting = list(self.urls)
        while waiting:
            for url in list(waiting):
                code = self._processes[url].poll()
                if code is not None:
                    raise ServerStartError(self._failure(url, f"its process exited with code {code}"))
                if _healthy(url):
                    waiting.remove(url)
            if waiting and time.monotonic() > deadline:
                raise ServerStartError(
                    self._failure(waiting[0], f"it did not answer GET /health within {self.startup_timeout:g} s")
                )
            if waiting:
                time.sleep(_POLL_S)

    def _failure(self, url: str, why: str) -> str:
        log = self.log_path(url)
        try:
            with open(
                os.open(log, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK), errors="replace"
            ) as text:  # never through a link
                tail = "\n".join(text.read().splitlines()[-_LOG_TAIL_LINES:])
        except OSError as err:
            tail = f"(the log cannot be read: {err})"
        return f"rollout server {url} did not start: {why}; log {log}, last lines:\n{tail}"


def _on_cpu(spec: ServerSpec) -> bool:
    if spec.gpus is not None:
        return False
    import torch

    return not torch.cuda.is_available()


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def _parse_cpus(text: str) -> set[int]:
    """A CPU list as taskset writes one: "3", "0-3", "0,2,4-5"."""
    cpus: set[int] = set()
    try:
        for part in text.split(","):
            first, _, last = part.strip().partition("-")
            cpus.update(range(int(first), int(last or first) + 1))
    except ValueError:
        cpus = set()
    if not cpus:
        raise ValueError(f"ServerSpec.cpus {text!r} is not a CPU list such as '1', '0-3' or '0,2,4-5'")
    return cpus


def _healthy(url: str) -> bool:
    try:
        return http.request(url, "GET", "/health", None, {}, timeout=5)[0] == 200
    except OSError:
        return False


def _signal_group(process: subprocess.Popen, signum: int) -> None:
    try:
        os.killpg(process.pid, signum)  # start_new_session: the group's id is the server's pid
    except ProcessLookupError:
        pass
