"""A bearer-token guard for the stock vLLM server (``--middleware`` with this module's ``RequireToken``).

vLLM's own ``--api-key`` covers only ``/v1``, ``/v2``, ``/inference`` and ``/cohere``; the development routes a
weight push needs (``/pause``, ``/update_weights``, ``/collective_rpc``, which runs any worker method by name) stay
open. This middleware wraps the whole application: every HTTP request but ``GET /health`` and every websocket must
carry ``Authorization: Bearer <token>``, the token being the server process's ``STARE_LIGHTNING_SERVER_TOKEN``.
Without that variable, or with one shorter than ``MIN_TOKEN_CHARS``, the server does not start: a guard configured
without its token is a mistake, not a choice.

It also stands before vLLM's adapter routes: ``POST /v1/load_lora_adapter`` loads a copy of the adapter (from a
directory, or sent inside the request) that the server checked and made itself (``adapter_check.py``), or is refused
(400) with the reason; an unload drops that copy.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import os

from stare_lightning.rollout.server.shared.token import TOKEN_ENV, check_token

_OPEN = {("GET", "/health")}
_LOAD, _UNLOAD = (
    ("POST", "/v1/load_lora_adapter"),
    ("POST", "/v1/unload_lora_adapter"),
)  # the liveness probe launchers and load balancers poll without credentials


class RequireToken:
    """ASGI middleware: refuse (401) any request without the server's bearer token."""

    def __init__(self, app) -> None:
        token = os.environ.get(TOKEN_ENV, "")
        if not token.strip():
            raise RuntimeError(
                f"{__name__}.RequireToken needs the server's token in the environment variable {TOKEN_ENV}: set it "
                "when starting the server (stare_lightning's launcher does)"
            )
        try:
            check_token(token, f"${TOKEN_ENV}")
        except ValueError as err:
            raise RuntimeError(str(err)) from None
        self.app = app
        self._expected = f"Bearer {token}".encode()
        self._token = token  # also keys the digest of an adapter sent inside its load request
        self._adapters = None  # adapter_check.CheckedAdapters, made at the first adapter load
        self._adapter_routes = _runtime_lora()

    async def __call__(self, scope, receive, send) -> None:
        kind = scope["type"]
        if kind not in ("http", "websocket") or self._allowed(scope):
            route = (scope.get("method"), scope.get("path")) if kind == "http" else None
            if route in (_LOAD, _UNLOAD) and self._adapter_routes:
                await self._adapter_route(route, scope, receive, send)
            else:
                await self.app(scope, receive, send)
            return
        if kind == "websocket":
            await send({"type": "websocket.close", "code": 1008, "reason": "Unauthorized"})
            return
        await _answer(
            send,
            401,
            "Unauthorized: this server needs 'Authorization: Bearer <token>'",
            [(b"www-authenticate", b"Bearer")],
        )

    async def _adapter_route(self, route, scope, receive, send) -> None:
        """A load goes to the engine as the checked copy's path (or is refused); an unload also drops the copy."""
        from stare_lightning.rollout.server.in_vllm import adapter_check

        body = await _whole_body(receive)
        if body is None:
            return  # the client went away
        if self._adapters is None:
            self._adapters = adapter_check.CheckedAdapters()
        if route == _LOAD:
            try:  # reading and checking a few MB: off the event loop, which serves every other request
                body = await asyncio.to_thread(adapter_check.rewritten_load, body, self._adapters, self._token)
            except (adapter_check.AdapterRefused, OSError) as err:
                await _answer(send, 400, f"adapter refused: {err}")
                return
        status = []

        async def noting_status(message) -> None:
            if message["type"] == "http.response.start":
                status.append(message["status"])
            await send(message)

        try:
            await self.app(_with_length(scope, len(body)), _replay(body, receive), noting_status)
        finally:
            name = adapter_check.adapter_name(body)
            if name is not None and route == _LOAD:
                self._adapters.settle(name, loaded=status == [200])
            elif name is not None and status == [200]:
                self._adapters.forget(name)

    def _allowed(self, scope) -> bool:
        if scope["type"] == "http" and (scope.get("method"), scope.get("path")) in _OPEN:
            return True
        given = [value for name, value in scope.get("headers", ()) if name.lower() == b"authorization"]
        # One header, compared in constant time (hmac.compare_digest) so the response time says nothing of the token.
        return len(given) == 1 and hmac.compare_digest(given[0], self._expected)


async def _answer(send, status: int, error: str, headers=()) -> None:
    body = json.dumps({"error": error}).encode()
    start = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *headers]
    await send({"type": "http.response.start", "status": status, "headers": start})
    await send({"type": "http.response.body", "body": body})


async def _whole_body(receive) -> bytes | None:
    parts, more = [], True
    while more:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        parts.append(message.get("body", b""))
        more = message.get("more_body", False)
    return b"".join(parts)


def _replay(body: bytes, receive):
    """An ASGI ``receive`` that gives ``body`` once, then whatever the connection sends (a disconnect)."""
    given = False

    async def replayed():
        nonlocal given
        if given:
            return await receive()
        given = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replayed


def _with_length(scope, length: int):
    headers = [(name, value) for name, value in scope.get("headers", ()) if name.lower() != b"content-length"]
    return dict(scope, headers=[*headers, (b"content-length", str(length).encode())])


def _runtime_lora() -> bool:
    """Whether vLLM serves its adapter routes in this process (without, a load answers 404 as vLLM does)."""
    try:
        from vllm import envs
    except ImportError:
        return False
    return bool(envs.VLLM_ALLOW_RUNTIME_LORA_UPDATING)
