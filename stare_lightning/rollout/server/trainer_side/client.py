"""The trainer's side of one vLLM server: token ids in, token ids and log-probs out, and the weight push.

Everything goes over the stock server's HTTP routes (no pickle in either direction): generation through the
token-in/token-out route ``/inference/v1/generate``, which also says which weight version produced each token, and
the push through vLLM's RL routes in their documented order (pause, start, one update per packed chunk, finish with
the version, resume). Every request carries the run's credential and has a timeout, so a server that stops answering
ends the run with one line naming it instead of a hang.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass

from stare_lightning.rollout.server.trainer_side import http

__all__ = ["Completion", "RolloutServerError", "ServerClient"]


class RolloutServerError(ConnectionError):
    """A rollout server refused a request or stopped answering; the message names it. A ``ConnectionError`` (an
    ``OSError``): the run ends with this one line, as with any other unreachable resource (``user_errors``).
    ``status``: the HTTP status of a refusal (None when the server did not answer)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Completion:
    """One sample: its token ids, their log-probs, the text, why it ended, and the weight versions it spans."""

    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str
    weight_versions: tuple[str, ...]


class ServerClient:
    def __init__(self, url: str, *, token: str | None, timeout: float) -> None:
        self.url, self.token, self.timeout = url.rstrip("/"), token, timeout

    def _request(
        self,
        method: str,
        path: str,
        body: dict | None = None,
        *,
        timeout: float | None = None,
        answer_json: bool = True,
    ) -> dict:
        """The JSON answer (``answer_json=False``: a route that answers in plain text, whose text is not read)."""
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        try:
            status, payload = http.request(self.url, method, path, data, headers, timeout or self.timeout)
        except OSError as error:  # a timeout, a refused or reset connection, a socket that is gone
            raise RolloutServerError(
                f"rollout server {self.url} did not answer {method} {path} within {timeout or self.timeout:g} s "
                f"({error})"
            ) from None
        if status >= 400:
            detail = payload[:500].decode(errors="replace")
            raise RolloutServerError(
                f"rollout server {self.url} refused {method} {path}: HTTP {status} {detail}", status=status
            )
        if not answer_json:
            return {}
        try:
            return json.loads(payload) if payload else {}
        except json.JSONDecodeError:
            raise RolloutServerError(
                f"rollout server {self.url} answered {path} with something other than JSON"
            ) from None

    def healthy(self, timeout: float = 10.0) -> bool:
        try:
            self._request("GET", "/health", timeout=timeout)
        except RolloutServerError:
            return False
        return True

    def weight_version(self) -> str:
        return str(self._request("GET", "/weight_info").get("weight_version"))

    def generate(self, prompt: list[int], sampling: dict, adapter: str | None = None) -> list[Completion]:
        """``sampling``: vLLM sampling parameters as JSON (n, max_tokens, temperature, seed, ...); ``adapter``: the
        loaded LoRA adapter to sample with (None: the served weights as they are)."""
        body = {"token_ids": list(prompt), "sampling_params": sampling, "return_token_ids": True, "output_mode": "text"}
        if adapter is not None:
            body["model"] = adapter
        answer = self._request("POST", "/inference/v1/generate", body)
        choices = sorted(answer.get("choices") or [], key=lambda c: c.get("index", 0))
        if len(choices) != sampling["n"]:
            raise RolloutServerError(
                f"rollout server {self.url} returned {len(choices)} samples, expected {sampling['n']}"
            )
        return [self._completion(choice) for choice in choices]

    def _completion(self, choice: dict) -> Completion:
        ids = [int(t) for t in choice.get("token_ids") or []]
        content = (choice.get("logprobs") or {}).get("content") or []
        # In text mode each entry names its token as text; the ids are ``token_ids``, position by position.
        if len(content) != len(ids) or any("token_id" in c and int(c["token_id"]) != t for c, t in zip(content, ids)):
            raise RolloutServerError(f"rollout server {self.url} returned log-probs that do not match its tokens")
        versions = tuple(str(span["version"]) for span in choice.get("weight_versions") or [])
        return Completion(
            token_ids=ids,
            logprobs=[float(c["logprob"]) for c in content],
            text=str(choice.get("text") or ""),
            finish_reason=str(choice.get("finish_reason")),
            weight_versions=versions,
        )

    # ------------------------------------------------------------------------------------- the weight push
    def init_transfer(self, init_info: dict) -> None:
        self._request("POST", "/init_weight_transfer_engine", {"init_info": init_info})

    def begin_push(self) -> None:
        """Stop admitting work once the requests in flight are done, then open a weight-update round."""
        self._request("POST", "/pause?mode=wait")
        self._request("POST", "/start_weight_update")

    def send_chunk(self, update_info: dict) -> None:
        self._request("POST", "/update_weights", {"update_info": update_info})

    def end_push(self, version: str) -> None:
        """Apply the round (the server loads every chunk at once) under ``version``, then serve again."""
        self._request("POST", "/finish_weight_update", {"weight_version": version})
        self._request("POST", "/resume")

    # ---------------------------------------------------------------------------------------- LoRA adapters
    def load_adapter(self, name: str, path: str) -> None:
        """Serve the adapter in directory ``path`` as model ``name`` (vLLM's runtime LoRA loading)."""
        # vLLM answers 404 both without the route (no runtime LoRA) and when it cannot read the adapter.
        unreadable = (
            ", or it cannot read that directory (rollout.server.transfer_dir must be a directory the servers' user "
            "can read, on their host)"
        )
        self._load_lora({"lora_name": name, "lora_path": path}, f"the adapter in {path}", unreadable)

    def load_adapter_files(self, name: str, files: dict[str, bytes]) -> None:
        """Serve the adapter ``files`` (a peft directory's, by name) as model ``name``, sent inside the request signed
        with the run's secret: for a server that cannot read the trainer's directories (``shared/adapter_wire.py``)."""
        from stare_lightning.rollout.server.shared.adapter_wire import inline_load_request

        if not self.token:
            raise RolloutServerError(
                f"rollout server {self.url}: an adapter sent to it is signed with the run's secret"
            )
        self._load_lora(inline_load_request(name, files, self.token), f"adapter {name}")

    def _load_lora(self, body: dict, what: str, other_cause: str = "") -> None:
        try:
            self._request("POST", "/v1/load_lora_adapter", body, answer_json=False)
        except RolloutServerError as error:
            if error.status in (404, 405):
                raise RolloutServerError(
                    f"rollout server {self.url} did not load {what} ({error}). Either it was started without runtime "
                    "LoRA (start it with --enable-lora --max-lora-rank R --max-loras K+1 and "
                    "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True in its environment, as `python -m stare_lightning serve "
                    f"model.lora.rank=R` does, or set rollout.lora_sync=merged){other_cause}",
                    status=error.status,
                ) from None
            raise

    def unload_adapter(self, name: str, timeout: float | None = None) -> None:
        self._request("POST", "/v1/unload_lora_adapter", {"lora_name": name}, timeout=timeout, answer_json=False)

    def push(self, chunks: Iterable[dict], version: str) -> None:
        self.begin_push()
        for chunk in chunks:
            self.send_chunk(chunk)
        self.end_push(version)
