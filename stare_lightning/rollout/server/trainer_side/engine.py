"""``ServerRolloutEngine``: the ``RolloutEngine`` of ``rollout.backend=server``, generation on separate vLLM servers.

Each prompt is one request with its own seed (vLLM seeds sample ``j`` with ``seed + j``, as the colocated engine
does), so a sample depends neither on the batch it came in nor on the server that drew it; prompts are dealt to the
servers in turn and sent concurrently. After every optimizer step ``sync_weights`` gathers the policy's full weights
on every rank (FSDP2's collectives), and rank 0 packs them into chunk files and pushes them to every server with
vLLM's weight-transfer protocol (``client.ServerClient.push``) under a new version; the other ranks wait for it at a
collective. Every response says which version produced it, and one from any other version than the last pushed
stops the run: no sample comes from weights the trainer no longer has, or from a half-finished push.

With ``rollout.lora_sync=adapter`` a push sends a LoRA policy's adapters only: rank 0 writes them as a peft
adapter directory (``rollout/adapters.py``) and every server loads it under the version's name through vLLM's own
adapter routes, by path, or with the files inside the request when the weights go over the network (a server on
another host sees none of the trainer's directories); requests name the adapter to sample with, so a response comes
from the version its request named. The servers keep ``max_staleness + 1`` versions loaded and never pause for a
push.

The chunks travel as files in a directory the trainer and the servers both see: ``/dev/shm`` on one host, a shared
file system across nodes (``rollout.server.transfer_dir``). The trainer holds that directory by descriptor and checks
before every push that nobody replaced it (``transfer_dir.py``); a weight holding NaN or inf is refused as it is
gathered, so it reaches no server.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from stare_lightning import distributed
from stare_lightning.rollout.adapter_versions import AdapterVersion, AdapterVersions
from stare_lightning.rollout.adapters import AdapterSync, adapter_weights
from stare_lightning.rollout.base import (
    Rollouts,
    Sample,
    SamplingParams,
    check_prompts,
    request_budgets,
    request_seeds,
    rollouts_from_samples,
)
from stare_lightning.rollout.server.trainer_side.client import Completion, RolloutServerError, ServerClient
from stare_lightning.rollout.transfer_dir import TransferDirectory
from stare_lightning.rollout.weights import finite_weights, iter_full_weights

__all__ = ["ServerRolloutEngine", "sampling_request"]


def sampling_request(params: SamplingParams, seed: int | None, budget: int) -> dict:
    """One prompt's vLLM sampling parameters as JSON: the colocated engine's (``vllm_settings.request_params``)."""
    return {
        "n": params.n,
        "max_tokens": budget,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k if params.top_k > 0 else -1,
        "seed": seed,
        "logprobs": 0,
        "detokenize": True,
        "skip_special_tokens": True,
        "stop": list(params.stop) or None,
        "include_stop_str_in_output": True,
    }


# Seconds one server may take to unload an adapter at the end of a run, before the run stops waiting for it.
UNLOAD_TIMEOUT_S = 5.0


class ServerRolloutEngine:
    # The servers keep their own copy of the weights: sync_weights must follow every optimizer step.
    holds_weight_copy = True

    def __init__(
        self,
        clients: Sequence[ServerClient],
        *,
        chunk_bytes: int,
        launched=None,
        transfer_dir: str | None = None,
        adapters: AdapterSync | None = None,
        run_tag: str = "run",
        network=None,
        inline_adapters: bool = False,
    ) -> None:
        if not clients:
            raise ValueError("ServerRolloutEngine needs at least one server")
        self.clients, self.chunk_bytes, self.launched = list(clients), chunk_bytes, launched
        # Adapters are named "<run_tag>-<version>": a server kept across runs may still hold an earlier run's "v3",
        # and reloading a name in place would let cached prefixes computed with its old weights be reused.
        self.adapters, self.run_tag = adapters, run_tag
        self.inline_adapters = inline_adapters  # adapters inside their load requests, not by path
        self._adapters = None
        if adapters is not None:
            self._adapters = AdapterVersions(
                adapters,
                load=self._load_on_servers,
                unload=self._unload_from_servers,
                prefix=run_tag,
                under=transfer_dir,
            )
        self.last_sync_bytes = 0
        self.transfer_under = transfer_dir
        self.network = network  # a net_push.NetworkPush (rollout.server.transfer=network), else None: files
        self.version: str | None = None  # the weights every server holds (None: the checkpoint it started from)
        self.pushes = 0
        self.last_sync_seconds = 0.0
        self._transfer_dir: TransferDirectory | None = None
        self._pool = ThreadPoolExecutor(max_workers=8 * len(self.clients), thread_name_prefix="rollout-server")

    # -- generation -------------------------------------------------------------------------------------
    def generate(
        self,
        prompt_ids: list[list[int]],
        params: SamplingParams,
        seeds: Sequence[int] | None = None,
        max_new_tokens: Sequence[int] | None = None,
    ) -> Rollouts:
        check_prompts(prompt_ids)
        budgets = request_budgets(params, len(prompt_ids), max_new_tokens)
        requests = zip(prompt_ids, request_seeds(params, len(prompt_ids), seeds), budgets)
        start = time.perf_counter()
        adapter = self._adapter_name(self.version)  # None: merged weights, or no push yet (the base is the policy)
        futures = [
            self._pool.submit(self._client(i).generate, prompt, sampling_request(params, seed, budget), adapter)
            for i, (prompt, seed, budget) in enumerate(requests)
        ]
        answers = [self._result(future, i) for i, future in enumerate(futures)]
        seconds = time.perf_counter() - start
        for i, completions in enumerate(answers):
            for completion in completions:
                self._check(completion, i)
        samples = [[Sample(c.token_ids, c.logprobs, c.text, c.finish_reason) for c in group] for group in answers]
        return rollouts_from_samples("the rollout servers", prompt_ids, samples, params.n, seconds)

    def _client(self, prompt_index: int) -> ServerClient:
        return self.clients[prompt_index % len(self.clients)]

    def _result(self, future, prompt_index: int) -> list[Completion]:
        try:
            return future.result()
        except RolloutServerError as error:
            raise RolloutServerError(f"{error}{self._exit_note(self._client(prompt_index).url)}") from None

    def _check(self, completion: Completion, prompt_index: int) -> None:
        """What the shared checks cannot name: the server that answered, and the weight version it answered with."""
        url = self._client(prompt_index).url
        if completion.finish_reason not in ("stop", "length"):
            raise RolloutServerError(
                f"rollout server {url} ended a request with finish_reason={completion.finish_reason!r}"
            )
        # An adapter's version is the model its request named; the base's weight version never changes then.
        if self.adapters is None and self.version is not None and set(completion.weight_versions) != {self.version}:
            raise RolloutServerError(
                f"rollout server {url} answered with weights {list(completion.weight_versions)}, expected "
                f"{self.version!r}: the last weight push did not reach it"
            )

    def _exit_note(self, url: str) -> str:
        for dead_url, code in self.launched.dead() if self.launched is not None else []:
            if dead_url == url:
                return f"; its process exited with code {code} (log: {self.launched.log_path(url)})"
        return ""

    # -- weights ----------------------------------------------------------------------------------------
    def sync_weights(self, model: torch.nn.Module) -> None:
        """Gather the policy's full weights on every rank; rank 0 pushes them to every server (call on every rank)."""
        start = time.perf_counter()
        weights = self.gather_weights(model, keep=False, policy=f"the policy of weight push {self.pushes + 1}")
        if weights is not None:
            self.push(weights)
        else:  # every rank counts the pushes, so every rank checks its responses against the same version
            self.pushes += 1
            self.expect_version(f"push-{self.pushes}")
        if distributed.is_distributed():  # no rank samples before rank 0's push is done
            distributed.all_reduce(torch.zeros(1))
        self.last_sync_seconds = time.perf_counter() - start

    def gather_weights(self, model: torch.nn.Module, *, keep: bool = True, policy: str = "the policy"):
        """The policy's full weights, gathered on every rank (FSDP2's collectives, so every rank calls this), as
        ``(name, tensor)`` pairs on rank 0 and None elsewhere. ``keep``: host copies, to push later while the
        trainer goes on changing its parameters; else a generator the caller must run out at once. A tensor
        holding NaN or inf raises ``NonFiniteWeights`` on every rank (``policy`` names the weights in the message)."""
        weights = finite_weights(adapter_weights(model) if self.adapters else iter_full_weights(model), policy)
        if distributed.rank() != 0:
            with torch.no_grad():
                for _ in weights:  # the gathers are collectives: every rank runs them, in the same order
                    pass
            return None
        if not keep:
            return weights
        with torch.no_grad():
            return [(name, tensor.detach().to("cpu", copy=True)) for name, tensor in weights]

    def push(self, weights, version: str | None = None) -> str:
        """Send ``weights`` (rank 0's ``gather_weights``) to every server under ``version`` (default: the next
        ``push-N``) and return it. Rank 0 only, and no collective: the caller makes the other ranks wait."""
        from stare_lightning.rollout.server.shared.transfer import write_chunks

        self.pushes += 1
        version = version or f"push-{self.pushes}"
        if self.adapters is not None:
            return self._load_adapter(weights, version)
        if self.network is not None:
            return self._push_network(weights, version)
        directory = self._directory()
        try:
            directory.check_in_place()
            # Every chunk is written before a server is paused: a weight refused while packing (a dtype, NaN) then
            # leaves the servers serving, with no round open.
            with torch.no_grad():
                chunks = list(write_chunks(weights, directory, chunk_bytes=self.chunk_bytes))
            self._each(ServerClient.begin_push)
            for chunk in chunks:
                self._each(lambda c, chunk=chunk: c.send_chunk(chunk))
            self._each(lambda c: c.end_push(version))
        finally:
            directory.clear()
        self.last_sync_bytes = sum(sum(chunk["tensor_sizes"]) for chunk in chunks)
        self.version = version
        return version

    def _push_network(self, weights, version: str) -> str:
        """The round over the network (``net_push.py``): every chunk packed, and its digest taken, before a server is
        paused, as with files."""
        from stare_lightning.rollout.server.shared.net_wire import pack_chunks

        with torch.no_grad():
            chunks = list(pack_chunks(weights, self.network.token, self.chunk_bytes))
        try:
            self.network.push(chunks, version)
        except RolloutServerError as error:  # a launched server that died says so, with its log
            named = [client.url for client in self.clients if client.url in str(error)]
            raise RolloutServerError(f"{error}{self._exit_note(named[0]) if named else ''}") from None
        self.last_sync_bytes = sum(buffer.numel() for _, buffer in chunks)
        self.version = version
        return version

    def _load_adapter(self, weights, version: str) -> str:
        """Every server loads the adapter ``weights`` as model ``version`` (``AdapterVersions`` keeps the window). No
        pause: requests in flight keep the adapter they named."""
        self.last_sync_bytes = self._adapters.add(weights, version).bytes
        self.version = version
        return version

    def _load_on_servers(self, version: AdapterVersion) -> None:
        if self.inline_adapters:
            self._each(lambda c: c.load_adapter_files(version.name, version.contents))
        else:
            self._each(lambda c: c.load_adapter(version.name, str(version.path)))

    def _unload_from_servers(self, version: AdapterVersion) -> None:
        self._each(lambda c: c.unload_adapter(version.name))

    def _unload_adapters(self) -> None:
        """Servers this run did not launch outlive it: take its adapter versions off them, whose files are about to
        go. Best effort, a few seconds a call: a server that is gone or stuck keeps them (vLLM's LRU bounds them)."""
        if self.launched is not None or self._adapters is None:
            return
        for name in self._adapters.names:
            for client in self.clients:
                with contextlib.suppress(RolloutServerError, OSError):
                    client.unload_adapter(name, timeout=UNLOAD_TIMEOUT_S)

    def _adapter_name(self, version: str | None) -> str | None:
        """The served adapter of ``version`` (None with merged weights or before the first push)."""
        return None if self._adapters is None or version is None else self._adapters.name_of(version)

    def _directory(self) -> TransferDirectory:
        """The run's transfer directory, made and announced to every server at the first push of merged weights."""
        if self._transfer_dir is None:
            directory = TransferDirectory(self.transfer_under)
            try:
                self._each(lambda c: c.init_transfer({"directory": str(directory.path)}))
            except BaseException:
                directory.remove()
                raise
            self._transfer_dir = directory
        return self._transfer_dir

    def expect_version(self, version: str) -> None:
        """On a rank that did not push: the servers now hold ``version`` (rank 0 pushed it)."""
        self.version = version

    def _each(self, call) -> None:
        """``call(client)`` on every server at once; the first failure, naming its server, stops the run."""
        futures = [(client, self._pool.submit(call, client)) for client in self.clients]
        for client, future in futures:
            try:
                future.result()
            except RolloutServerError as error:
                raise RolloutServerError(f"{error}{self._exit_note(client.url)}") from None

    # -- lifecycle --------------------------------------------------------------------------------------
    def sleep(self) -> None:  # the servers' memory is their own
        pass

    def wake(self) -> None:
        pass

    def close(self) -> None:
        self._unload_adapters()
        if self._adapters is not None:
            self._adapters.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self.network is not None:
            self.network.close()
        if self._transfer_dir is not None:
            self._transfer_dir.remove()
            self._transfer_dir = None
        if self.launched is not None:
            self.launched.stop()
            self.launched = None
