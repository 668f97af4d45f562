"""``RolloutConfig``: the typed ``rollout`` config group (sampling and the engine), checked in ``__post_init__``.

``SamplingParams`` (rollout/base.py) is built from a validated ``RolloutConfig`` and repeats none of its checks.

``engine_kwargs`` go to ``vllm.LLM`` as they are. ``__post_init__`` refuses what it can tell without vLLM (not a
mapping, a key the project sets itself, any key with a backend that takes none); ``vllm.check_engine_kwargs``
checks the keys against the installed vLLM and runs where the engine is built, never at config time. Which
settings a backend honours is its entry's business (rollout/backends.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from stare_lightning.config.checks import choice, flag, number
from stare_lightning.rollout.backends import RolloutBackend, backend_choices, declared_backend
from stare_lightning.rollout.base import SamplingParams
from stare_lightning.rollout.lora_sync import LORA_SYNC_MODES, check_backend_takes

# rollout.server.transfer: how a push's weights reach the servers (trainer_side/placement.py picks for auto).
TRANSFER_MODES = ("auto", "files", "network")

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
# rollout.max_staleness's ceiling. Rank 0 keeps a full host copy of the weights for every version the producer may
# still push (K + 1 of them), and samples many versions old train poorly (docs/results/async.md measures K <= 4).
MAX_STALENESS = 8
# rollout.server.host for Unix sockets in a private directory: reachable by this user on this host only.
UNIX_HOST = "unix"
LOCAL_HOSTS = (UNIX_HOST, *LOOPBACK_HOSTS)
DEFAULT_MAX_TURNS = 4  # tool calls answered per episode when rollout.max_turns is null
# vllm.LLM arguments the project sets itself, and where each comes from.
ENGINE_OWNED_KEYS = {
    "model": "use model.name_or_path",
    "tokenizer": "the tokenizer is the model's: use model.name_or_path",
    "dtype": "the engine computes in the trainer's dtype: use trainer.precision or model.dtype",
    "seed": "use seed (the engine's seed follows the run's)",
    "enable_sleep_mode": "use rollout.enable_sleep_mode",
    "gpu_memory_utilization": "use rollout.gpu_memory_utilization",
    "tensor_parallel_size": "use rollout.tensor_parallel_size",
    "logprobs_mode": "the engine needs processed_logprobs (its log-probs must be the trainer's)",
    "distributed_executor_backend": "the engine sets it (external_launcher under several trainer ranks)",
    "skip_tokenizer_init": "the engine needs its tokenizer to return response texts",
    **dict.fromkeys(
        ("enable_lora", "max_lora_rank", "max_loras", "max_cpu_loras"),
        "set from model.lora and rollout.max_staleness when rollout.lora_sync serves adapters",
    ),
}
# Shown when a key is unknown (those the installed vLLM has).
COMMON_ENGINE_KEYS = (
    "max_num_batched_tokens",
    "enable_chunked_prefill",
    "max_model_len",
    "max_num_seqs",
    "kv_cache_memory_bytes",
    "enable_prefix_caching",
    "enforce_eager",
)


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


@dataclass
class RolloutConfig:
    backend: str = "auto"
    """The rollout engine: `auto` takes vLLM where installed, else Hugging Face generate."""
    n: int = 8
    """Samples per prompt in training (the group size, >= 2)."""
    max_new_tokens: int = 32
    """Longest response; with a tool, the whole episode after the prompt, tool replies included."""
    max_turns: int | None = None
    """Tool calls answered per episode (with a tool); null: 4."""
    temperature: float = 1.0
    """Training sampling temperature."""
    top_p: float = 1.0
    """Training nucleus sampling threshold (1: off)."""
    top_k: int = 0
    """Training top-k sampling (0: off)."""
    val_n: int = 4
    """Validation samples per problem (a benchmark's `data.val_sets` entry can override)."""
    val_temperature: float = 1.0
    """Validation sampling temperature."""
    val_top_p: float = 1.0
    """Validation nucleus sampling threshold."""
    gpu_memory_utilization: float = 0.3
    """vLLM: share of GPU memory the engine may take (weights and KV cache)."""
    tensor_parallel_size: int = 1
    """vLLM: GPUs one engine spans."""
    enable_sleep_mode: bool = False
    """vLLM: free the engine's GPU memory during the update (GPUs only)."""
    canary_threshold: float = 0.05
    """Largest tolerated token-mean |engine - trainer| log-prob difference (nats)."""
    canary_patience: int = 3
    """Steps in a row above `canary_threshold` before the run stops."""
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    """More `vllm.LLM` arguments, checked against the installed vLLM, e.g. `max_num_seqs`."""
    server: ServerConfig = field(default_factory=ServerConfig)
    """With `backend: server`: where the vLLM servers run and how the trainer reaches them."""
    max_staleness: int = 0
    """With `backend: server`: how many policy versions the samples of a step may lag behind it. 0: the
    synchronous step; K >= 1: step t+1's batch is generated by the policy of step t+1-K while the trainer updates
    (step/producer.py)."""
    lora_sync: str = "auto"
    """With `model.lora`: what each weight sync sends the engine. `adapter`: the adapters only, served as a vLLM LoRA
    over the base; `merged`: the whole model with the adapters folded in; `auto`: adapter on GPUs where the backend
    serves adapters (vllm, server) and the rank is one vLLM serves (up to 512), merged otherwise (on a CPU too:
    vLLM's CPU LoRA kernels are slow)."""

    def __post_init__(self) -> None:
        p = "rollout."
        choice(f"{p}backend", self.backend, backend_choices())
        for key in ("n", "max_new_tokens", "val_n", "tensor_parallel_size", "canary_patience"):
            number(f"{p}{key}", getattr(self, key), low=1, integer=True)
        if self.max_turns is not None:
            number(f"{p}max_turns", self.max_turns, low=1, integer=True)
        if self.n < 2:
            raise ValueError(f"{p}n={self.n} is out of range: must be >= 2 for group-relative advantages")
        number(f"{p}top_k", self.top_k, low=0, integer=True)
        for key in ("temperature", "val_temperature", "canary_threshold"):
            number(f"{p}{key}", getattr(self, key), low=0.0, low_open=True)
        for key in ("top_p", "val_top_p", "gpu_memory_utilization"):
            number(f"{p}{key}", getattr(self, key), low=0.0, high=1.0, low_open=True)
        flag(f"{p}enable_sleep_mode", self.enable_sleep_mode)
        self.engine_kwargs = _checked_engine_kwargs(self.engine_kwargs, self.backend)
        if isinstance(self.server, Mapping):
            self.server = ServerConfig(**_plain(self.server))
        self.server.check(self.backend)
        check_max_staleness(self.max_staleness)
        choice(f"{p}lora_sync", self.lora_sync, LORA_SYNC_MODES)
        self._check_backend_supports(declared_backend(self.backend))

    def _check_backend_supports(self, backend: RolloutBackend | None) -> None:
        """Settings the named backend cannot honour are refused (``auto`` resolves later: vLLM or HF, both
        colocated, both taking every colocated setting but the engine-specific ones checked where it resolves)."""
        name = self.backend
        if self.max_staleness and (backend is None or not backend.served):
            raise ValueError(
                f"rollout.max_staleness={self.max_staleness} does nothing with rollout.backend={name}: an "
                "engine inside the trainer cannot generate while the trainer updates; use rollout=server"
            )
        check_backend_takes(self.lora_sync, backend, name)
        if backend is None or backend.in_process_memory:
            return
        if self.gpu_memory_utilization != RolloutConfig.gpu_memory_utilization:
            where = "a launched server's share is rollout.server.gpu_memory_utilization" if backend.served else (
                "this backend keeps no engine memory of its own")  # fmt: skip
            raise ValueError(
                f"rollout.gpu_memory_utilization does nothing with rollout.backend={name}: it sizes an engine inside "
                f"the trainer; {where}"
            )
        if (self.enable_sleep_mode and not backend.sleep_mode) or self.tensor_parallel_size != 1:
            raise ValueError(
                f"rollout.enable_sleep_mode and rollout.tensor_parallel_size do nothing with rollout.backend={name}: "
                "they configure a vLLM engine inside the trainer"
                + (", and a server keeps its own memory and GPUs" if backend.served else "")
                + "; leave them at false and 1"
            )
        if self.engine_kwargs and not backend.engine_kwargs:
            raise ValueError(
                f"rollout.engine_kwargs={self.engine_kwargs} is not allowed with rollout.backend={name}: they go to "
                "an in-process vllm.LLM"
                + (
                    "; a server takes its settings on its command line (rollout/server/trainer_side/launch.py)"
                    if backend.served
                    else ""
                )  # fmt: skip
            )

    def episode_turns(self) -> int:
        """Tool calls answered per episode (with a tool)."""
        return DEFAULT_MAX_TURNS if self.max_turns is None else self.max_turns

    def training_sampling(self) -> SamplingParams:
        """How training rollouts are sampled: ``n`` per prompt at ``temperature``, ``top_p``, ``top_k``."""
        return SamplingParams(
            n=self.n,
            max_new_tokens=self.max_new_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
        )

    def validation_sampling(
        self,
        n: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        max_new_tokens: int | None = None,
    ) -> SamplingParams:
        """How validation samples are drawn: ``val_n`` per prompt at ``val_temperature`` and ``val_top_p``, each
        replaced by the argument of the same meaning when one is given (a benchmark's own settings)."""
        return SamplingParams(
            n=self.val_n if n is None else n,
            max_new_tokens=self.max_new_tokens if max_new_tokens is None else max_new_tokens,
            temperature=self.val_temperature if temperature is None else temperature,
            top_p=self.val_top_p if top_p is None else top_p,
        )


def check_max_staleness(value: Any) -> None:
    """``rollout.max_staleness``: an integer in [0, ``MAX_STALENESS``], refused with what it means and why the bound."""
    try:
        number("rollout.max_staleness", value, low=0, high=MAX_STALENESS, integer=True)
    except ValueError as error:
        raise ValueError(
            f"{error} (how many policy versions a step's samples may lag behind it; rank 0 holds K + 1 full copies "
            "of the weights in host memory, and samples many versions old train poorly)"
        ) from None


def check_staleness_overrides(overrides: Sequence[str]) -> None:
    """Check ``rollout.max_staleness`` given on the command line before Hydra composes: a value Hydra cannot merge
    into the integer field would otherwise fail with its generic merge error, which does not say what the key
    takes. A sweep is checked value by value."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    mine = [o for o in overrides if o.partition("=")[0].lstrip("+~") == "rollout.max_staleness" and "=" in o]
    for override in OverridesParser.create().parse_overrides(mine):
        values = list(override.sweep_iterator()) if override.is_sweep_override() else [override.value()]
        for value in values:
            check_max_staleness(value)


def _plain(value: Any) -> Any:
    """OmegaConf containers (and any other mapping or list) as plain dicts and lists, all the way down."""
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):  # ListConfig is a Sequence
        return [_plain(v) for v in value]
    return value


def _checked_engine_kwargs(value: Any, backend: str) -> dict[str, Any]:
    """``rollout.engine_kwargs`` as a plain dict, after the checks that need no vLLM."""
    if not isinstance(value, Mapping):
        raise ValueError(f"rollout.engine_kwargs={value!r} is not allowed: must be a mapping of vllm.LLM arguments")
    kwargs = _plain(value)
    refuse_owned_engine_keys(kwargs)
    entry = declared_backend(backend) if backend in backend_choices() else None
    if kwargs and entry is not None and not entry.engine_kwargs and not entry.served:
        raise ValueError(
            f"rollout.engine_kwargs={kwargs} is not allowed with rollout.backend={backend}: these settings go to the "
            f"vLLM engine, which the {backend} backend does not use, so they would do nothing; remove them or use "
            "rollout=vllm"
        )
    return kwargs


def refuse_owned_engine_keys(engine_kwargs: Mapping[str, Any]) -> None:
    """Refuse keys that are not argument names or that the project sets itself (naming the setting to use)."""
    for key in engine_kwargs:
        if not isinstance(key, str) or not key.isidentifier():
            raise ValueError(f"rollout.engine_kwargs.{key} is not allowed: keys are vllm.LLM argument names")
        if key in ENGINE_OWNED_KEYS:
            raise ValueError(
                f"rollout.engine_kwargs.{key} is not allowed: the project sets it; {ENGINE_OWNED_KEYS[key]}"
            )
