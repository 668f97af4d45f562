"""A bearer-token guard for the stock vLLM server (``--middleware stare_lightning.rollout.server.auth.RequireToken``).

vLLM's own ``--api-key`` covers only ``/v1``, ``/v2``, ``/inference`` and ``/cohere``; the development routes a
weight push needs (``/pause``, ``/update_weights``, ``/collective_rpc``, which runs any worker method by name) stay
open. This middleware wraps the whole application: every HTTP request but ``GET /health`` and every websocket must
carry ``Authorization: Bearer <token>``, the token being the server process's ``STARE_LIGHTNING_SERVER_TOKEN``.
Without that variable the server does not start: a guard configured without its token is a mistake, not a choice.
"""

from __future__ import annotations

import hmac
import json
import os

TOKEN_ENV = "STARE_LIGHTNING_SERVER_TOKEN"
_OPEN = {("GET", "/health")}  # the liveness probe launchers and load balancers poll without credentials
# secrets.token_urlsafe(32) gives 43 characters; 32 printable characters chosen at random are beyond guessing, a
# short one (a word, a PIN) is not, and the token is all that stands between a network and the weight routes.
MIN_TOKEN_CHARS = 32


def check_token(token: str | None, where: str) -> None:
    """Refuse a token that is missing, shorter than ``MIN_TOKEN_CHARS`` or not plain printable characters (a header
    value cannot carry whitespace or control characters intact), naming ``where`` it came from, never the token."""
    if not token or not token.strip():
        raise ValueError(
            f"{where} is blank: set it to a secret, e.g. $(python -c 'import secrets; "
            "print(secrets.token_urlsafe(32))')"
        )
    if len(token) < MIN_TOKEN_CHARS:
        raise ValueError(
            f"{where} has {len(token)} characters; a server credential needs at least {MIN_TOKEN_CHARS}, e.g. "
            "$(python -c 'import secrets; print(secrets.token_urlsafe(32))')"
        )
    if not token.isprintable() or any(character.isspace() for character in token):
        raise ValueError(
            f"{where} holds whitespace or control characters: a credential is one word of printable characters"
        )


class RequireToken:
    """ASGI middleware: refuse (401) any request without the server's bearer token."""

    def __init__(self, app) -> None:
        token = os.environ.get(TOKEN_ENV, "")
        if not token.strip():
            raise RuntimeError(
                f"{__name__}.RequireToken needs the server's token in the environment variable {TOKEN_ENV}: set it "
                "when starting the server (stare_lightning's launcher does)"
            )
        self.app = app
        self._expected = f"Bearer {token}".encode()

    async def __call__(self, scope, receive, send) -> None:
        kind = scope["type"]
        if kind not in ("http", "websocket") or self._allowed(scope):
            await self.app(scope, receive, send)
            return
        if kind == "websocket":
            await send({"type": "websocket.close", "code": 1008, "reason": "Unauthorized"})
            return
        body = json.dumps({"error": "Unauthorized: this server needs 'Authorization: Bearer <token>'"}).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"www-authenticate", b"Bearer"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})

    def _allowed(self, scope) -> bool:
        if scope["type"] == "http" and (scope.get("method"), scope.get("path")) in _OPEN:
            return True
        given = [value for name, value in scope.get("headers", ()) if name.lower() == b"authorization"]
        # One header, compared in constant time (hmac.compare_digest) so the response time says nothing of the token.
        return len(given) == 1 and hmac.compare_digest(given[0], self._expected)
